"""The OpenAI-compatible HTTP server: aiohttp app, protocol, async engine wrapper (imports jpaged, never the reverse)."""
