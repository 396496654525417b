"""A process without the job's secret that attacks a fault-tolerant job's membership.

    python intruder.py join --lighthouse URL --honeypot HOST:PORT --seconds S --out FILE
    python intruder.py vote --managers URL[,URL...] --seconds S --out FILE

``join``: runs its own torchft Manager (its own store and process group, no secret) against the
job's quorum service and asks for quorums over and over, claiming a far higher step than any
replica (so it would be the peer others heal from) and naming ``--honeypot`` as its process
group's rendezvous store (whoever accepted it as a member would connect there).
``vote``: sends forged commit votes (False and True, for every group rank and step 0..200) to
the replicas' manager servers, as a local process that found their ports can.
Writes ``{"attempts": n, "admitted": n, "errors": [...]}`` to ``--out`` after every attempt
(so a test may stop it at any time), and creates ``--ready`` after its first attempt; it
runs until ``--seconds`` pass or it is terminated.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta


def _report(args: argparse.Namespace, out: dict) -> None:
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f)
    os.replace(tmp, args.out)
    if args.ready and not os.path.exists(args.ready):
        open(args.ready, "w").close()


def join(args: argparse.Namespace) -> dict:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    honeypot = args.honeypot

    class Honeypot(ProcessGroupGloo):  # type: ignore[misc]
        def get_reconfigure_handle(self) -> str:
            return json.dumps({"id": "intruder-pg", "store": honeypot, "global_rank": None})

    host = args.host
    store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    end = time.monotonic() + args.seconds
    while True:  # the job's quorum service may not be up yet
        try:
            manager = Manager(
                pg=Honeypot(timeout=timedelta(seconds=5)), load_state_dict=lambda s: None,
                state_dict=lambda: {"x": 1}, min_replica_size=1, use_async_quorum=False,
                replica_id="aaa-intruder", store_addr=host, store_port=store.port,
                lighthouse_addr=args.lighthouse, rank=0, world_size=1, hostname=host,
                timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=3),
                connect_timeout=timedelta(seconds=5),
                heartbeat_interval=timedelta(milliseconds=100))
            break
        except Exception:  # noqa: BLE001
            if time.monotonic() > end:
                raise
            time.sleep(0.2)
    manager._step = 1_000_000  # the highest step: it would be every replica's heal source
    out = {"attempts": 0, "admitted": 0, "errors": []}
    while time.monotonic() < end:
        out["attempts"] += 1
        try:
            manager.start_quorum(timeout=timedelta(seconds=1))
            if manager.errored() is None and manager.num_participants() > 0:
                out["admitted"] += 1
        except Exception as exc:  # noqa: BLE001 - refused: what the test expects
            if len(out["errors"]) < 5:
                out["errors"].append(f"{type(exc).__name__}: {str(exc)[:200]}")
        _report(args, out)
        time.sleep(0.1)
    manager.shutdown(wait=False)
    return out


def vote(args: argparse.Namespace) -> dict:
    from torchft._torchft import ManagerClient

    out = {"attempts": 0, "admitted": 0, "errors": []}
    clients: dict[str, object] = {}
    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end:
        for url in args.managers.split(","):
            try:
                if url not in clients:
                    clients[url] = ManagerClient(url, connect_timeout=timedelta(seconds=2))
            except Exception as exc:  # noqa: BLE001 - its server is gone: the run ended
                if len(out["errors"]) < 5:
                    out["errors"].append(f"{type(exc).__name__}: {str(exc)[:120]}")
                continue
            for rank in (0, 1):
                for verdict in (False, True):
                    out["attempts"] += 1
                    try:
                        clients[url].should_commit(rank, step, verdict,
                                                   timeout=timedelta(milliseconds=50))
                    except Exception as exc:  # noqa: BLE001 - a vote nobody collects times out
                        if len(out["errors"]) < 5:
                            out["errors"].append(f"{type(exc).__name__}: {str(exc)[:120]}")
        step = (step + 1) % 200
        _report(args, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["join", "vote"])
    parser.add_argument("--lighthouse", default="")
    parser.add_argument("--honeypot", default="")
    parser.add_argument("--managers", default="")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ready", default="")
    args = parser.parse_args()
    result = join(args) if args.mode == "join" else vote(args)
    _report(args, result)


if __name__ == "__main__":
    main()
