"""The benchmark tools' command line: failures a user can fix end in one line, not a traceback."""

from __future__ import annotations

import os

import pytest

from cli_harness import refusal


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv", [
    ["bench", "allreduce", "--world-sizes", "2", "--sizes", "4K", "--algorithms", "ring", "--transports", "tcp",
     "--repeats", "1", "--net", "1gbit", "--out", ""],
    ["bench", "train", "--models", "mlp", "--world-size", "2", "--steps", "1", "--rounds", "1", "--net", "1gbit",
     "--out", ""],
])
def test_net_without_root_is_a_one_line_error(monkeypatch, argv, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    message = refusal(argv, capsys, one_line=False).splitlines()[-1]  # (after bench allreduce's "# world size 2: ...")
    assert message.startswith(f"ringtrain bench {argv[1]}: network emulation needs root"), message


@pytest.mark.multiprocess
def test_a_benchmark_whose_ranks_run_out_of_time_is_one_message_not_a_traceback(capsys):
    # (RankFailed reached the user as a traceback of the parent's own frames)
    from ringtrain import cli

    rc = cli.main(["bench", "allreduce", "--world-sizes", "2", "--sizes", "64M", "--repeats", "50", "--timeout", "1",
                   "--no-mpi", "--no-horovod", "--transports", "tcp", "--algorithms", "ring"])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err[-2000:]
    assert "ringtrain bench allreduce: ranks [0, 1] still running after 1s" in err, err[-2000:]


@pytest.mark.timeout(60)
def test_a_rank_that_failed_without_a_word_is_no_colon_and_blank_line():
    # (kill -9 of a rank mid-run: "ringtrain bench allreduce: rank 2 was killed by SIGKILL:" then a blank line)
    import subprocess
    import sys
    import tempfile

    from ringtrain.bench.procs import RankFailed, _wait_all

    for code, said, expected in [(3, "", "rank 0 exited with status 3"),
                                 (4, "print('no data')", "rank 0 exited with status 4:\nno data\n")]:
        with tempfile.TemporaryFile(mode="w+") as log:
            proc = subprocess.Popen([sys.executable, "-c", f"{said}\nimport sys; sys.exit({code})"], stdout=log,
                                    stderr=subprocess.STDOUT)
            with pytest.raises(RankFailed) as caught:
                _wait_all([proc], [log], timeout=30)
        assert str(caught.value) == expected


@pytest.mark.timeout(60)
def test_ranks_on_emulated_hosts_use_the_hosts_interface_whatever_this_machine_names(monkeypatch, tmp_path):
    # GLOO_SOCKET_IFNAME=ens5, right for this machine, went on to the ranks under --net, where each
    # host has eth0 alone: gloo failed in every rank ("Unable to find address for: ens5").
    import subprocess

    from ringtrain.bench.procs import run_ranks

    class Hosts:  # stands in for an EmulatedNetwork: what run_ranks asks of it, the ranks started here
        def addr(self, i):
            return "127.0.0.1"

        def host_id(self, i):
            return f"host{i}"

        def popen(self, i, argv, *, env, **kwargs):
            return subprocess.Popen(argv, env=env, **kwargs)

    (tmp_path / "ifname.py").write_text(
        "import os\nfrom ringtrain.bench.procs import emit\n"
        "if os.environ['RANK'] == '0':\n    emit({'ifname': os.environ.get('GLOO_SOCKET_IFNAME')})\n")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ens5")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    assert run_ranks("ifname", [], 2, timeout=30, net=Hosts(), extra_env=env) == [{"ifname": "eth0"}]
