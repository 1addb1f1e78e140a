"""Engine options given as a dict or, on the command line, a JSON object (vLLM's
`--speculative-config`, `--kv-events-config`): parsed and their field names checked in one place."""

import dataclasses
import json


def parsed(value, name: str, kinds: tuple = (dict,)):
    """`value`, parsed from JSON when it is a string that `kinds` does not take; ValueError naming
    the option `name` when it is not JSON or not one of `kinds`."""
    if isinstance(value, str) and not isinstance(value, kinds):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, kinds):
        expected = " or ".join("a dict or a JSON object" if k is dict else "a list or a JSON array" if k is list
                               else k.__name__ for k in kinds)
        raise ValueError(f"{name} must be {expected}, got {type(value).__name__}")
    return value


def option_fields(value, name: str, cls) -> dict:
    """`value` (a dict or a JSON object string) as a dict of `cls`'s fields; ValueError naming the
    option `name` when it is not JSON, not an object, or has fields `cls` does not."""
    value = parsed(value, name)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{name} has unknown fields {unknown}; expected some of {sorted(names)}")
    return dict(value)
