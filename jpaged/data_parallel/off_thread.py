"""A call sent to data-parallel replicas whose slow part runs off their engine loop (replica.py).
Its own module: the replica runs as `python -m jpaged.data_parallel.replica`, where a class defined
in that module would be `__main__`'s, not the one the front end pickled."""


class OffThreadCall:
    """A call whose slow part does not hold up the replica's steps: `background(engine)` runs in a
    worker thread (reading files: an adapter; it may read the engine, not change it), then
    `finish(engine, value)` on the loop, between steps (what changes the engine: registering it).
    Sent to the replica pickled, as a ("call", id, fn) command."""

    def __init__(self, background, finish):
        self.background, self.finish = background, finish
