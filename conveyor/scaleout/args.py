"""`conveyor serve`'s scale-out flags, apart from the ingress so that parsing imports neither Ray nor FastAPI."""

from __future__ import annotations

import argparse


def add_scaleout_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out (Ray Serve)")
    g.add_argument("--replicas", type=int, default=1,
                   help="engine replicas; more than 1 runs each as a Ray Serve deployment behind one ingress "
                        "(needs `pip install conveyor[ray]`)")
    g.add_argument("--router", default=None, choices=["prefix", "least-loaded"],
                   help="how the ingress picks a replica: prefix = where the prompt's longest text prefix went "
                        "last, unless that replica is --router-imbalance sequences busier than the least loaded; "
                        "least-loaded = fewest running + waiting sequences (default: prefix)")
    g.add_argument("--router-imbalance", type=float, default=32.0,
                   help="sequences by which a prefix's replica may be busier than the least-loaded one before the "
                        "prefix router gives up affinity")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join ('auto', host:6379 or ray://host:10001), or 'local' to start one "
                        "here even with --replicas 1; default: a local Ray instance when --replicas > 1")
    g.add_argument("--replica-cpus", type=float, default=1.0,
                   help="CPUs Ray reserves per replica; on CPU it is also each engine's thread count unless "
                        "--threads is given")
    g.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs per replica (default: 1 where torch sees CUDA, else 0)")
