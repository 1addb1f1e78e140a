"""The engine: scheduler + runner + detokenizer behind add_request / step / abort."""
