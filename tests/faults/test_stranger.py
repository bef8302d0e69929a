"""A stranger in the job: a rank whose RINGTRAIN_SECRET differs (or is missing) must be refused
before any data moves, end to end through ringtrain.init, and no error text may show a secret.

(The tcp transport's own tests check the handshake itself; this checks what a user sees.)
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mp_harness import RankError, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

SECRETS = ["job-secret-7d41a9", "stranger-secret-0b3c55"]


def join_and_reduce(rank, world_size, port, transport, secrets_):
    import ringtrain

    if secrets_[rank] is None:
        os.environ.pop("RINGTRAIN_SECRET", None)
    else:
        os.environ["RINGTRAIN_SECRET"] = secrets_[rank]
    try:
        comm = ringtrain.init(rank, world_size, "127.0.0.1", port, transport=transport, timeout=4.0)
        buf = np.full(4, rank + 1.0, np.float32)
        comm.allreduce(buf)
        comm.close()
        return ("data moved", buf.tolist())
    except ringtrain.CommError as exc:
        return (type(exc).__name__, str(exc))


@pytest.mark.parametrize("secrets_", [SECRETS, [SECRETS[0], None]], ids=["wrong", "missing"])
@pytest.mark.parametrize("transport", ["tcp", "shm", "auto", "torch"])
def test_a_rank_with_another_secret_is_refused_before_data_moves(transport, secrets_):
    results = run_ranks(join_and_reduce, 2, transport, secrets_, timeout=60)
    for r in results:
        assert not isinstance(r, RankError), f"{r}\n{r.tb}"
    moved = [r for r in results if r[0] == "data moved"]
    assert not moved, f"data moved between ranks with different secrets on {transport}: {results}"
    assert any(r[0] == "AuthError" for r in results), results
    for kind, text in results:
        assert not any(s and s in text for s in SECRETS), f"a secret appears in an error: {text}"
