"""The Responses store (`store`, OpenAI's default true): finished responses by id, with the chat
messages that continue their conversation, for `previous_response_id` and GET /v1/responses/{id}.

Bounded twice, the oldest dropped first: by count (--responses-store-size) and by bytes
(--responses-store-bytes, counted as the JSON size of the stored response and conversation, the
request's input included); `metadata` is held to OpenAI's limits (protocol.check_metadata).
"""

import collections
import json

from serving.protocol import APIError

RESPONSES_STORE_BYTES = 256 * 2**20  # --responses-store-bytes' default


def stored_bytes(response: dict, history: list[dict]) -> int:
    """What one stored response costs against the byte bound: its JSON size and its conversation's."""
    return len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(history, ensure_ascii=False))


class ResponseStore:
    """Finished responses by id, with the chat messages that continue their conversation; at most
    `size` of them (0: none kept) and `max_bytes` in all (stored_bytes), the oldest dropped first.
    A response larger than `max_bytes` alone is not kept."""

    def __init__(self, size: int, max_bytes: int = RESPONSES_STORE_BYTES):
        self.size, self.max_bytes = size, max_bytes
        self.bytes = 0
        self._items: collections.OrderedDict[str, tuple[dict, list[dict], int]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def enabled(self) -> bool:
        return self.size > 0 and self.max_bytes > 0

    def put(self, response: dict, history: list[dict]):
        if not self.enabled:
            return
        cost = stored_bytes(response, history)
        if cost > self.max_bytes:
            return
        self._items[response["id"]] = (response, history, cost)
        self.bytes += cost
        while len(self._items) > self.size or self.bytes > self.max_bytes:
            self.bytes -= self._items.popitem(last=False)[1][2]

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        item = self._items.get(response_id)
        if item is None:
            raise APIError(f"Response with id {response_id!r:.100} not found.", status=404, param=param,
                           code="response_not_found")
        return item[0], item[1]

    def pop(self, response_id: str):
        self.get(response_id)
        self.bytes -= self._items.pop(response_id)[2]
