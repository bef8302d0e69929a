"""The `ringtrain` command."""
import sys


def main(argv=None) -> int:
    print("ringtrain: not yet", file=sys.stderr)
    return 2
