"""Data-parallel serving: N engine replicas behind one front end (`--data-parallel-size`), and the
router that picks each request's replica (`--dp-routing`) from the replicas' own KV events."""
