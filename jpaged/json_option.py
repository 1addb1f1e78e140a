"""Engine options given as a dict or, on the command line, a JSON object (vLLM's
`--speculative-config`, `--kv-events-config`): parsed and their field names checked in one place."""

import dataclasses
import json


def option_fields(value, name: str, cls) -> dict:
    """`value` (a dict or a JSON object string) as a dict of `cls`'s fields; ValueError naming the
    option `name` when it is not JSON, not an object, or has fields `cls` does not."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object, got {type(value).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{name} has unknown fields {unknown}; expected some of {sorted(names)}")
    return dict(value)
