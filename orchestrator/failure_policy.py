"""What the run does about a lost actor: replace it in place, restart from the restore point, or fail.

    decide(loss, ledger, situation) -> Decision

One pure function over plain data (no Ray, no actors), so every rule is tested on its own
(tests/unit/test_failure_policy.py). The controller (orchestrator/controller/) gathers the inputs and
carries the decision out: `replacement.replace_worker` (replace), `Controller.recover` (restart),
`ElasticScaling.leave` (leave), or raising (fail).

The rules, in order:
- The worker's own code raised (reading data, building the model, a bug): it would raise again, so it
  is never retried; the run fails with that error as it is (its traceback is the user's to read).
- A loss is *replaced* in place only while the controller loop is training, under the parameter-server
  transport (the shards hold everything a PS worker has; a collective group cannot take in a new member),
  without backup workers or tasks (their k-of-n rounds and portions keep their own books), for one known
  training worker (dead or hung) whose placement bundle is on a live node (a dead node's bundle may be
  unplaceable). Every other loss *restarts* every actor from the restore point (orchestrator/recovery.py).
- Under `--workers MIN..MAX` (`Situation.elastic_min` set) a lost worker (dead, hung, its node lost or
  draining) that is a member, and whose run stays at MIN or above without it, *leaves*
  (orchestrator/membership.py): the run goes on without a restart, and it is not counted as a failure.
  A loss that would go below MIN is decided like any other.
- Either way it counts against --max-failures (-1: no bound); past the bound the run fails with one line
  that names the last good checkpoint and the `--resume` command for the run's directory, or says that
  no checkpoint was taken (nothing to resume: start again). The ledger still records the loss as what
  it called for (`remedy`), so summary.json shows every failure seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath

REPLACE, RESTART, FAIL = "replace", "restart", "fail"
# Under --workers MIN..MAX: the worker leaves the run, which goes on without a restart (not a failure).
LEAVE = "leave"

# A kind of loss besides those of `RunLost` ("worker", "shard", "hang", "node"): a worker's call
# raised an error of the worker's own code.
USER_CODE = "user_code"


def describe_loss(kind: str, target: int | None) -> str:
    """What was lost, in words: "worker 1 lost", "worker 1 hung", "a parameter-server shard lost"."""
    if kind == "hang":
        return "a parameter-server wait hung" if target is None else f"worker {target} hung"
    if kind == USER_CODE:
        return "the worker's own code raised" if target is None else f"worker {target}'s own code raised"
    noun = {"shard": "parameter-server shard"}.get(kind, kind)
    return f"a {noun} lost" if target is None else f"{noun} {target} lost"


@dataclass(frozen=True)
class Loss:
    """What was lost: its kind, and the worker rank or shard index when known."""

    kind: str  # "worker", "shard", "hang", "node", or USER_CODE
    target: int | None
    detail: str = ""

    def __str__(self) -> str:
        return f"{describe_loss(self.kind, self.target)}: {self.detail}"


@dataclass(frozen=True)
class LedgerView:
    """The failure ledger as the policy needs it."""

    failures: int  # failures counted so far (restarts and replacements), this one not included
    max_failures: int  # --max-failures; -1: no bound
    checkpoint: str | None = None  # the restore point's checkpoint file; None before the first
    run_dir: str | None = None  # the run's directory, named in the `--resume` advice


@dataclass(frozen=True)
class Situation:
    """Where the run is when the loss is seen. The defaults describe anywhere outside the controller
    loop (workers starting, a phase switch, the final checkpoint, an attempt already ended)."""

    training: bool = False  # the controller loop is handing out work (a replacement's calls join it)
    transport: str = "collective"  # the running phase's
    own_books: bool = False  # backup workers or backup tasks
    cut_replicas: bool = False  # --fsdp D: a replica's workers share one FSDP group (strategies/sharded_ps.py)
    workers: int = 0  # training workers: ranks 0 .. workers-1
    host_alive: bool = False  # the lost worker's placement bundle is on a live node
    elastic_min: int = 0  # --workers MIN..MAX: MIN (0: a fixed-size run)
    members: int = 0  # elastic: workers in the run now, the lost one included if it is a member
    member: bool = False  # elastic: the lost worker is one of them


@dataclass(frozen=True)
class Decision:
    action: str  # REPLACE, RESTART, LEAVE or FAIL
    reason: str  # one line: why; for FAIL, what the run stops with
    remedy: str | None = None  # REPLACE or RESTART: what the loss called for, also when the bound stops
    # the run (the ledger records it as that); None for the worker's own error, which is no loss


def decide(loss: Loss, ledger: LedgerView, situation: Situation) -> Decision:
    if loss.kind == USER_CODE:
        return Decision(FAIL, f"{loss}; it would again, so it is never retried")
    if _leaves(loss, situation):
        stays = f"the run stays at {situation.members - 1} workers, MIN {situation.elastic_min} or more"
        return Decision(LEAVE, stays, LEAVE)
    remedy, why = _remedy(loss, situation)
    number = ledger.failures + 1
    if ledger.max_failures != -1 and number > ledger.max_failures:
        stops = f"{loss} (failure {number}; --max-failures {ledger.max_failures} reached): the run stops; "
        return Decision(FAIL, stops + _what_is_left(ledger), remedy)
    return Decision(remedy, why, remedy)


def _what_is_left(ledger: LedgerView) -> str:
    """Where the run can go on from: its last good checkpoint and the command, or that there is none."""
    if ledger.checkpoint is None:
        return (
            "no checkpoint was taken, so there is nothing to resume: start it again "
            "(with --checkpoint-steps N a failed run can be resumed)"
        )
    run_dir = ledger.run_dir or str(PurePath(ledger.checkpoint).parent.parent)  # RUN/checkpoints/NAME
    return f"last good checkpoint: {ledger.checkpoint}; continue with `distrain run --resume {run_dir}`"


def _leaves(loss: Loss, s: Situation) -> bool:
    """An elastic run's member lost while the others keep it at MIN or above: a leave, not a failure."""
    if not s.elastic_min or loss.kind not in ("worker", "hang", "node") or loss.target is None:
        return False
    return s.member and s.members - 1 >= s.elastic_min


def _remedy(loss: Loss, s: Situation) -> tuple[str, str]:
    """Replace in place or restart from the restore point, with the reason."""
    if not s.training:
        return RESTART, "lost outside the training loop: every actor restarts from the restore point"
    if s.transport != "ps":
        return RESTART, "a collective group cannot take in a new member"
    if s.own_books:
        return RESTART, "backup workers and tasks keep their own books of each round"
    if s.cut_replicas:
        return RESTART, "a cut replica's workers share one FSDP group, which cannot take in a new member"
    if loss.kind not in ("worker", "hang") or loss.target is None:
        return RESTART, "not one known worker (a shard, a node, a wait on the shards)"
    if loss.target >= s.workers:
        return RESTART, f"rank {loss.target} is not a training worker"
    if not s.host_alive:
        return RESTART, "its placement bundle's node is gone"
    return REPLACE, "the shards hold everything a parameter-server worker has"
