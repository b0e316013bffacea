"""`conveyor bench` (placeholder until issue 4 lands)."""


def main(argv: list[str]) -> int:
    print("conveyor bench: not built yet")
    return 1
