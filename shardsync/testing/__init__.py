"""Test helpers for shardsync and for its users' own tests.

- `FakeHub`: a Hugging Face Hub and its CDN on loopback, speaking enough of the protocol for
  huggingface_hub itself, with a request log and injectable faults (`shardsync.testing.faults`).
- `build_checkpoint`: real sharded safetensors checkpoints with seeded random weights.
- Real servers and processes on loopback, which the tests and the benchmarks share (import
  each from its module): `shardsync.testing.seaweedfs` (a SeaweedFS S3 gateway),
  `shardsync.testing.nginx` (nginx serving a directory) and `shardsync.testing.daemons` (a
  ``shardsync daemon`` process, ready by sd_notify).

Run ``python -m shardsync.testing --help`` to serve or build checkpoints from a shell.
"""

from __future__ import annotations

from shardsync.testing.checkpoints import Checkpoint, build_checkpoint
from shardsync.testing.fakehub import FakeHub, serve_in_thread
from shardsync.testing.faults import (
    Bandwidth,
    ChangeEtag,
    ChunkedBody,
    CutBody,
    Fault,
    FaultPlan,
    FlipByte,
    IgnoreIfRange,
    IgnoreRange,
    Latency,
    NoEtag,
    ReplaceObject,
    Rule,
    ShiftedRange,
    SlowDrip,
    Stall,
    Status,
    WrongContentRange,
)
from shardsync.testing.hub_http import RequestRecord

__all__ = [
    "Bandwidth",
    "ChangeEtag",
    "Checkpoint",
    "ChunkedBody",
    "CutBody",
    "FakeHub",
    "Fault",
    "FaultPlan",
    "FlipByte",
    "IgnoreIfRange",
    "IgnoreRange",
    "Latency",
    "NoEtag",
    "ReplaceObject",
    "RequestRecord",
    "Rule",
    "ShiftedRange",
    "SlowDrip",
    "Stall",
    "Status",
    "WrongContentRange",
    "build_checkpoint",
    "serve_in_thread",
]
