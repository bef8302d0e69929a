"""Running the ``ringtrain`` command in the test's own process."""

from __future__ import annotations

from ringtrain import cli


def refusal(argv: list[str], capsys, one_line: bool = True) -> str:
    """Run ``ringtrain argv``, which must refuse it before running: exit status ``cli.REFUSED``
    (argparse's own errors included), no traceback, and with ``one_line`` a single line of stderr.
    Returns what it wrote to stderr, without the last newline."""
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # (argparse: usage, then the error)
        code = exc.code
    err = capsys.readouterr().err
    assert code == cli.REFUSED, f"{argv}: exit status {code!r}, not {cli.REFUSED} (a refused command line); {err}"
    assert "Traceback" not in err, err
    if one_line:
        assert err.count("\n") == 1, f"{argv}: not one line: {err!r}"
    return err.rstrip("\n")
