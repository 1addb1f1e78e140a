"""Images in: loading them (media.py) and finding them in chat messages (chat_parts.py).

Kept import-light: nothing here imports jax or transformers, and PIL and aiohttp are imported by
the functions that use them, so `jpaged serve --help` and a text-only server pay for none of it."""
