

def write_result(res: dict, path: str | None) -> None:
    """A benchmark's JSON record: to ``path`` (``--json``), else to stdout."""
    import json

    text = json.dumps(res, indent=1)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
