"""The ledger: a disallow list of consumed samples, kept across SLURM runs.

**Consumed** means delivered to the training loop before a checkpoint that was committed.
Samples still in a shuffle buffer, a DataLoader's prefetch queue or a packing leftover are
not consumed; a packed document counts when its last token was delivered, and the tokens
delivered of a document cut across sequences are recorded as a token count, so an elastic
resume continues the document instead of repeating it.

**Layout.** ``PATH/run-RUN/rank-NNNNN.ledger`` (the rank in 5 digits), one msgpack file per (run, rank), rewritten
atomically at each commit; it holds the commits of that rank in that run, each the set of
positions consumed since the previous one, per epoch, as one roaring bitmap of ordinals per
shard. Plain data with a checksum: loading never runs code, a torn file is detected.

**Watermarks.** ``commit()`` returns a watermark -- the last commit and its step for every
run in this training's lineage, plus the epoch -- which goes into the checkpoint. Reading
the ledger under a watermark counts only those commits (other ranks' by step), so resuming
from an older checkpoint (a rewind after a loss spike, or a crash between the ledger commit
and the checkpoint write) never treats samples from later steps as consumed.
"""

from __future__ import annotations

import logging
import operator
import posixpath
import time
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from wdsraft.core.distributed import rank_and_world_size
from wdsraft.core.errors import LedgerError, StateMismatchError
from wdsraft.core.fields import PROVENANCE_FIELD, shard_of_key
from wdsraft.io.storage import exists, write_bytes_atomic
from wdsraft.ledger.consumed import ConsumedSet, PieceOrder, _piece_positions, _pieces, positions_of, refuse_repeats
from wdsraft.ledger.gathered import SnapshotChain, process_group
from wdsraft.ledger.identity import Identity, ShardIdentities
from wdsraft.ledger.merged import Merged, merge_under, read_rank_files, shared
from wdsraft.ledger.rank_file import SUFFIX, RankFile, counted, default_run_id
from wdsraft.ledger.reading import list_rank_files, parallel_map, read_optional
from wdsraft.ledger.snapshot import LedgerReads, Snapshot, late_marker_url, snapshot_url, write_snapshot
from wdsraft.pipeline.datapipeline import state_epoch
from wdsraft.pipeline.shardlists import UrlList

logger = logging.getLogger(__name__)


class Ledger:
    """The consumed-sample ledger of one training, at ``path`` (a shared directory or ``s3://`` prefix).

    Typical use, one call at checkpoint time and one at start::

        ledger = wds.Ledger("/shared/run42/ledger")
        saved = load_newest_checkpoint()                      # None on the first run
        mode = ledger.resume(loader, saved and saved["data"])  # "fresh", "exact" or "elastic"
        for step, batch in enumerate(ledger.track(loader)):
            ...
            if step % 1000 == 0:
                data = ledger.checkpoint(loader, step)         # every rank, then a barrier
                torch.save({"model": ..., "data": data}, path)  # rank 0 (or each rank)
    """

    def __init__(
        self,
        path: str,
        run: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        snapshot_wait: float = 0.0,
    ):
        detected_rank, detected_world = rank_and_world_size()
        self.path = path.rstrip("/")
        self.rank = detected_rank if rank is None else rank
        self.world_size = detected_world if world_size is None else world_size
        self.run = run or default_run_id(self.world_size)
        self.lineage: dict[str, int] = {}  # earlier runs -> their last commit this training builds on
        self.lineage_steps: dict[str, int | None] = {}  # earlier runs -> the step of that commit
        self.last_step: int | None = None
        self.commit_number = 0
        self.pending: dict[int, ConsumedSet] = {}  # epoch -> delivered since the last commit
        self._file: RankFile | None = None
        self._order = PieceOrder()
        #: Whether the stream may deliver a sample twice in an epoch by design (shards drawn with replacement);
        #: otherwise such a repeat stops the run (see ``refuse_repeats``). ``track()`` finds it out; set it
        #: yourself when you call ``record()`` directly on such a stream.
        self.repeats_expected = False
        self._identities = ShardIdentities(self.path)
        self._to_record: dict[str, Identity] = {}  # identities read from the dataset, for the next commit
        #: For a run that resumed elastically: the epoch and lineage whose consumed set it skips.
        self.skip: dict[str, Any] | None = None
        #: Without torch.distributed, how long ranks other than 0 wait in ``resume()`` for the snapshot rank 0
        #: writes of the watermark they read (so that a restart reads the ranks' files once, not once per rank).
        self.snapshot_wait = snapshot_wait
        #: What the last read of the ledger took (the snapshot it started from, the rank files read).
        self.last_read: Merged | None = None
        self._highest_step: int | None = None  # of this rank's commits in this run
        # Under torch.distributed: the snapshots written at checkpoints (see gathered.py), and what rank 0
        # read at resume of the watermark this run builds on (their base).
        self._chain = SnapshotChain(self.path, self.run)
        self._resumed: tuple[dict[str, int], dict[str, int | None], Merged] | None = None

    # -- recording ---------------------------------------------------------------------------------

    def record(self, batch: Any, epoch: int) -> None:
        """Note what a batch delivered to the training loop holds (consumed once committed). ``None`` is a step
        with no data (``even_ends="pad"`` once this rank has run out): nothing to note."""
        if batch is None:
            return
        if isinstance(batch, dict) and PROVENANCE_FIELD in batch:  # LLM sequences: pieces of documents
            pieces = _pieces(batch)
            self._order.check(pieces, epoch)
            positions = _piece_positions(pieces)
        else:
            positions = positions_of(batch)
        consumed = self.pending.setdefault(epoch, ConsumedSet())
        whole: dict[str, list[int]] = {}
        for shard, ordinal, token_end, complete in positions:
            if complete:
                whole.setdefault(shard, []).append(ordinal)
            elif token_end is not None:
                consumed.add_tokens(shard, ordinal, token_end)
        for shard, ordinals in whole.items():
            if not self.repeats_expected:
                consumed.add_samples(shard, refuse_repeats(shard, ordinals, consumed.samples.get(shard), epoch))
            else:
                consumed.add_samples(shard, ordinals)

    def track(self, loader: Any) -> Iterator[Any]:
        """Iterate ``loader``, recording each batch as it is handed to the training loop."""
        if getattr(_webloader_dataset(loader), "repetitions", 1) != 1:
            # Batches would be recorded under the loader's epoch while the dataset moves through its own.
            raise LedgerError(
                "ledger", "the dataset inside the WebLoader repeats (repeat/with_epoch): put them on the WebLoader"
            )
        if not hasattr(loader, "epoch"):
            # Every epoch would be recorded as epoch 0: a sample of the second would read as consumed twice.
            raise LedgerError(
                "ledger",
                f"{type(loader).__name__} has no epoch, and the ledger records consumed samples per epoch: track a "
                "wds.WebLoader or a wdsraft pipeline (or a loader whose `epoch` attribute set_epoch advances)",
            )
        self.repeats_expected = _draws_with_replacement(_iterated_dataset(loader))
        for batch in loader:
            self.record(batch, _epoch_of(loader))
            yield batch

    def commit(self, step: int | None = None) -> dict[str, Any]:
        """Write what was delivered since the last commit; returns the watermark for the checkpoint.

        Every rank commits (before the checkpoint is written); the commit is atomic.
        """
        step = None if step is None else operator.index(step)  # (a numpy or torch integer is fine too)
        if step is None and self.world_size > 1 and self.commit_number == 0:
            logger.warning(
                "ledger: commit() without a step on %d ranks: other ranks' commits are then counted by commit "
                "number, which is only right if every rank commits at the same points; pass the training step",
                self.world_size,
            )
        if self._file is None:
            url = self._rank_url()
            self._refuse_reused_run(url)
            self._file = RankFile(
                url, self.run, self.rank, self.world_size, dict(self.lineage), dict(self.lineage_steps)
            )
        # The dataset identity of every shard this process records positions in, read once per shard (its
        # index) and checked against what earlier commits recorded: positions in another dataset under the
        # same names must not count.
        touched = {
            shard_of_key(key) for consumed in self.pending.values() for key in (*consumed.samples, *consumed.tokens)
        }
        self._to_record.update(self._identities.check(touched))
        commit = {
            "commit": self.commit_number + 1,
            "step": step,
            "time": time.time(),
            "epochs": {str(epoch): consumed.to_plain() for epoch, consumed in self.pending.items() if consumed},
            "shards": dict(self._to_record),
        }
        self._file.commits.append(commit)
        try:
            self._mark_late(commit)
            self._file.save()
        except BaseException:
            self._file.commits.pop()  # (nothing changed: the same commit can be tried again)
            raise
        self._to_record = {}
        self.commit_number += 1
        self.last_step = step
        if step is not None:
            self._highest_step = step if self._highest_step is None else max(self._highest_step, step)
        self.pending = {}
        return self.watermark()

    def _mark_late(self, commit: dict[str, Any]) -> None:
        """Before a commit of something at a step this rank already reached is saved, leave its late marker:
        a snapshot of that step written before it would lack it (see snapshot.py)."""
        step = commit["step"]
        if step is not None and commit["epochs"] and self._highest_step is not None and step <= self._highest_step:
            write_bytes_atomic(late_marker_url(self.path, self.run, self.rank, commit["commit"], step), b"")

    def watermark(self, epoch: int | None = None) -> dict[str, Any]:
        lineage, steps = dict(self.lineage), dict(self.lineage_steps)
        if self.commit_number:
            lineage[self.run], steps[self.run] = self.commit_number, self.last_step
        return {"ledger": self.path, "lineage": lineage, "steps": steps, "epoch": epoch, "skip": self.skip}

    def adopt_identities(self, shards: Iterable[str], recorded: dict[str, Identity]) -> None:
        """Record at the next commit, for these shards, the identities another ledger recorded (``recorded``,
        shard URL -> identity) instead of reading them from the dataset now, which may have changed or be out
        of reach (``wdsraft ledger merge``); a shard it has none for is not checked either. ``shards`` may be
        a ledger's shard keys: a later pass's key (``URL#pass=p``) stands for its shard, as in ``commit``."""
        shards = {shard_of_key(key) for key in shards}
        self._identities.checked.update({shard: recorded.get(shard) for shard in shards})
        self._to_record.update({shard: recorded[shard] for shard in shards if shard in recorded})

    # -- reading -----------------------------------------------------------------------------------

    def files(self) -> list[str]:
        """URLs of every rank file under the ledger path."""
        return list_rank_files(self.path)

    def rank_files(self, progress: str | None = None) -> Iterator[RankFile]:
        """Every rank file, read in parallel (bounded); ``progress``: a tqdm bar's name, where many."""
        return read_rank_files(self.files(), progress)

    def consumed(
        self, epoch: int, lineage: dict[str, int] | None = None, steps: dict[str, int | None] | None = None
    ) -> ConsumedSet:
        """The merged consumed set of an epoch, counting only the commits within ``lineage`` and
        ``steps`` (default: this ledger's own watermark, including its commits so far)."""
        if lineage is None:
            mark = self.watermark()
            lineage, steps = mark["lineage"], mark["steps"]
        return self.merged(lineage, steps).epochs.get(epoch, ConsumedSet())

    def merged(
        self,
        lineage: dict[str, int],
        steps: dict[str, int | None] | None = None,
        known: Iterable[RankFile] = (),
        reads: LedgerReads | None = None,
    ) -> Merged:
        """Every epoch's consumed set under a watermark: from the newest usable snapshot within it, plus
        the rank files of the runs it does not cover (all runs of the lineage where there is none).
        ``known``, ``reads``: rank files (whole), and the snapshots, late markers and listings, that the
        caller read already (a ``wdsraft ledger`` command that surveyed the ledger first): not read again."""
        self.last_read = merge_under(self.path, lineage, steps, self._identities, known=known, reads=reads)
        return self.last_read

    def compact(
        self,
        lineage: dict[str, int] | None = None,
        steps: dict[str, int | None] | None = None,
        known: Iterable[RankFile] = (),
        reads: LedgerReads | None = None,
    ) -> str:
        """Write the snapshot of the ledger under a watermark (default: this ledger's own); returns its URL.
        Later reads under that watermark, or one that builds on it, start from it. ``known``, ``reads``: as
        for ``merged``."""
        if lineage is None:
            mark = self.watermark()
            lineage, steps = mark["lineage"], mark["steps"]
        merged = self.merged(lineage, steps, known=known, reads=reads)
        summaries = merged.summaries()
        for run, commit in lineage.items():
            # A rank committing this step later would leave no late marker (its first commit there): the
            # snapshot would miss it for good. Only a step every rank reached can be compacted.
            step = (steps or {}).get(run)
            mark_of_run = step if step is not None else -commit
            summary = summaries.get(run)
            if summary is not None and mark_of_run not in summary.complete():
                raise LedgerError(
                    self.path,
                    f"cannot compact run {run} at {'step ' + str(step) if step is not None else f'commit {commit}'}: "
                    "not every rank of the run has committed there yet (compact a step every rank reached)",
                )
        return write_snapshot(self._snapshot_of(merged, lineage, steps))

    def _skip_set(self, epoch: int, lineage: dict[str, int], steps: dict[str, int | None] | None) -> ConsumedSet:
        """The consumed set a resume skips, its shards checked against the dataset (refused before anything
        is skipped where they differ). Under torch.distributed rank 0 reads it and broadcasts it, and every rank
        checks its share of the shards: a restart reads the ledger and each shard's index once, not once per
        rank. Rank 0 then writes the snapshot of that watermark (where it read rank files), so later resumes
        under it read one object."""

        def compute() -> ConsumedSet:
            self._wait_for_snapshot(lineage, steps)
            merged = self.merged(lineage, steps)
            self._resumed = (dict(lineage), dict(steps or {}), merged)
            if self.rank == 0 and merged.files_read:
                self._write_snapshot(merged, lineage, steps)
            consumed = merged.epochs.get(epoch, ConsumedSet())
            if process_group() is None:
                self._check_dataset(consumed)
            return consumed

        consumed = shared(compute, self._identities)
        if process_group() is not None:
            self._check_dataset(consumed)  # (every rank its share, together)
        # Each rank records the identities of its share of the skip set in its next commit (all of them, the
        # whole set's, in every rank file would be ranks x 10^5 entries at the first gather).
        checked = self._identities.checked
        mine = self._share({shard_of_key(key) for key in (*consumed.samples, *consumed.tokens)})
        self._to_record.update({url: found for url in mine if (found := checked.get(url)) is not None})
        return consumed

    def _snapshot_of(self, merged: Merged, lineage: dict[str, int], steps: dict[str, int | None] | None) -> Snapshot:
        recorded = dict(self._identities.recorded)
        return Snapshot(
            self.path,
            dict(lineage),
            dict(steps or {}),
            merged.epochs,
            recorded,
            self._identities.unrecorded_seen,
            ranks=merged.rank_commits(),
            runs=merged.summaries(),
        )

    def _write_snapshot(self, merged: Merged, lineage: dict[str, int], steps: dict[str, int | None] | None) -> None:
        try:
            url = write_snapshot(self._snapshot_of(merged, lineage, steps))
        except Exception as exn:  # (a snapshot only saves later reads: training goes on without it)
            logger.warning("could not write the ledger snapshot of %s: %s", self.path, exn)
            return
        logger.info("ledger: wrote the snapshot %s (%d rank files merged)", url, merged.files_read)

    def _wait_for_snapshot(self, lineage: dict[str, int], steps: dict[str, int | None] | None) -> None:
        """Without a process group, ranks other than 0 give rank 0 ``snapshot_wait`` seconds to write the
        snapshot of this watermark, then read what is there (the rank files, if it never came)."""
        if self.rank == 0 or self.snapshot_wait <= 0:
            return
        url, deadline, pause = snapshot_url(self.path, lineage, steps), time.monotonic() + self.snapshot_wait, 0.5
        while not exists(url):
            if time.monotonic() >= deadline:
                logger.warning("no ledger snapshot %s after %.0f s: reading the rank files", url, self.snapshot_wait)
                return
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 8.0)

    def _learn_own_lineage(self) -> None:
        """The identities this rank's files of the earlier runs recorded (an exact resume reads the same
        shards as this rank did then; the whole ledger is not read for it). The shards of each file's last
        counted commit, those being read at the checkpoint and read again first, are checked now; the
        others as commits name them."""
        recent: set[str] = set()
        urls = [posixpath.join(self.path, f"run-{run}", f"rank-{self.rank:05d}{SUFFIX}") for run in self.lineage]
        for run, url, raw in zip(self.lineage, urls, parallel_map(read_optional, urls), strict=True):
            if raw is None:
                continue
            rank_file = RankFile.parse(url, raw)
            last: dict[str, Any] | None = None
            for commit in rank_file.commits:
                if counted(commit, run, self.lineage, self.lineage_steps):
                    self._identities.learn(commit, url)
                    last = commit if commit["epochs"] else last
            for record in (last or {}).get("epochs", {}).values():
                recent.update(map(shard_of_key, record["samples"]), map(shard_of_key, record["tokens"]))
        self._to_record.update(self._identities.check(recent))

    def _check_dataset(self, consumed: ConsumedSet) -> None:
        """Refuse, before anything is skipped, a dataset whose shards are not those the skip set names.

        Each of several ranks checks its own share of the shards: one index read per shard per restart, not
        one per shard per rank, nor all of them on one rank (10^5 shards are minutes of reads). Under
        torch.distributed the ranks then exchange what they found, so a shard that differs stops every rank
        together, naming it. Without a process group it stops the rank that checks it, and any other rank
        that reads the shard is stopped at its first commit, which checks every shard it recorded positions
        in. (Keys of later passes of a mixture, ``URL#pass=p``, are checked under their shard's URL.)"""
        mine = self._share({shard_of_key(key) for key in (*consumed.samples, *consumed.tokens)})
        group = process_group()
        if group is None:
            self._to_record.update(self._identities.check(mine))
            return
        refusal = None
        try:
            self._to_record.update(self._identities.check(mine))
        except StateMismatchError as exn:
            refusal = str(exn)
        found = {url: self._identities.checked[url] for url in mine if url in self._identities.checked}
        everyone: list[Any] = [None] * group.get_world_size()
        group.all_gather_object(everyone, (refusal, found))
        for other, (_refusal, their_found) in enumerate(everyone):
            if other != group.get_rank():
                self._identities.checked.update(their_found)  # (compared with the dataset there: not read again)
        for other, (their_refusal, _found) in enumerate(everyone):
            if their_refusal is not None:
                mine_too = other == group.get_rank()
                raise StateMismatchError(their_refusal if mine_too else f"(found by rank {other}) {their_refusal}")

    def _share(self, shards: set[str]) -> set[str]:
        """This rank's share of ``shards`` for the identity checks (by a hash of the URL)."""
        group = process_group()
        rank, world = (group.get_rank(), group.get_world_size()) if group is not None else (self.rank, self.world_size)
        return {url for url in shards if zlib.crc32(url.encode()) % world == rank} if world > 1 else shards

    # -- checkpoints -------------------------------------------------------------------------------

    def checkpoint(self, loader: Any, step: int | None = None) -> dict[str, Any]:
        """Commit and return what goes into the training checkpoint: the loader's state and the watermark.

        Under torch.distributed it is collective (every rank calls it at the same points, as it commits
        anyway): rank 0 gathers the new commits and writes the snapshot of the watermark (gathered.py)."""
        state = loader.state_dict()
        watermark = self.commit(step)
        # The epoch the state is in, also right before the first batch after a resume (when the loader has
        # not started one yet). At an epoch's end, that epoch: other ranks may still be in it.
        epoch = state_epoch(state)
        watermark["epoch"] = _epoch_of(loader) if epoch is None else epoch
        dist = process_group()
        if dist is not None and self._file is not None:  # (every rank checkpoints at the same points)
            self._chain.gather(self._file, watermark, self._base(), dist)
        return {"loader": state, "ledger": watermark}

    def _base(self) -> Merged | None:
        """What resume() read of the watermark this run resumed from, where it read exactly that."""
        if self._resumed is not None and self._resumed[:2] == (self.lineage, self.lineage_steps):
            return self._resumed[2]
        return None

    def resume(self, loader: Any, saved: dict[str, Any] | None) -> str:
        """Resume ``loader`` from a checkpoint's ``data`` (what ``checkpoint`` returned).

        Same configuration: the loader's exact state is loaded ("exact"). Changed
        configuration (world size, workers, seed, shards): the loader starts the saved epoch
        afresh and skips every position consumed under the checkpoint's watermark
        ("elastic"). No checkpoint: "fresh".
        """
        # A reused run id (a relaunch inside one SLURM allocation, say) is refused now, not at the first
        # checkpoint after hours of training.
        self._refuse_reused_run(self._rank_url())
        if not saved:
            return "fresh"
        watermark = saved.get("ledger") if isinstance(saved, dict) else None
        if not (isinstance(watermark, dict) and isinstance(watermark.get("lineage"), dict) and "loader" in saved):
            # (a whole training checkpoint, or another tool's, instead of the "data" that checkpoint() returned)
            keys = sorted(saved)[:6] if isinstance(saved, dict) else type(saved).__name__
            raise LedgerError(
                self.path, f"resume() takes what Ledger.checkpoint() returned ({{'loader', 'ledger'}}), not {keys}"
            )
        if str(watermark.get("ledger", "")).rstrip("/") != self.path:
            raise LedgerError(self.path, f"the checkpoint's ledger is {watermark['ledger']}, not this one")
        self.lineage = dict(watermark["lineage"])
        self.lineage_steps = dict(watermark.get("steps") or {})
        if loader.matches(saved["loader"]):
            skip = watermark.get("skip")
            if skip is not None:  # the saved run was itself elastic: it skipped this set, so must we
                self.skip = skip
                consumed = self._skip_set(skip["epoch"], skip["lineage"], skip.get("steps"))
                _dataset_of(loader).skip_consumed(consumed, skip["epoch"])
            self._learn_own_lineage()
            loader.load_state_dict(saved["loader"])
            return "exact"
        epoch = watermark["epoch"] or 0
        consumed = self._skip_set(epoch, self.lineage, self.lineage_steps)
        logger.warning(
            "configuration changed: elastic resume of epoch %d, skipping %d consumed samples",
            epoch,
            consumed.count(),
        )
        _warn_about_unknown_shards(_dataset_of(loader), consumed)
        self.skip = {"epoch": epoch, "lineage": dict(self.lineage), "steps": dict(self.lineage_steps)}
        _dataset_of(loader).skip_consumed(consumed, epoch)
        _set_epoch(loader, epoch)
        _continue_counters(loader, saved["loader"], epoch)
        return "elastic"

    def _rank_url(self) -> str:
        return posixpath.join(self.path, f"run-{self.run}", f"rank-{self.rank:05d}{SUFFIX}")

    def _refuse_reused_run(self, url: str) -> None:
        if exists(url):  # rewriting it would drop the commits that checkpoints of that run point to
            raise LedgerError(
                url,
                f"run id {self.run!r} already has a ledger for rank {self.rank}: every launch needs its own "
                "(set WDSRAFT_RUN, or pass Ledger(run=...), for relaunches inside one job)",
            )


def _epoch_of(loader: Any) -> int:
    epoch = getattr(loader, "epoch", 0)
    return max(int(epoch), 0)


def _webloader_dataset(loader: Any) -> Any:
    """A WebLoader's dataset (None for another loader)."""
    return getattr(getattr(loader, "loader", None), "dataset", None)


def _iterated_dataset(loader: Any) -> Any:
    """The dataset a loader iterates: a WebLoader's, a torch DataLoader's, or the loader itself (a pipeline)."""
    dataset = _webloader_dataset(loader)
    return dataset if dataset is not None else getattr(loader, "dataset", loader)


def _dataset_of(loader: Any) -> Any:
    """The dataset a loader iterates, which a resume tells what to skip."""
    dataset = _iterated_dataset(loader)
    if not hasattr(dataset, "skip_consumed"):
        raise LedgerError("ledger", f"{type(dataset).__name__} cannot skip consumed samples (use a wdsraft pipeline)")
    return dataset


def _warn_about_unknown_shards(dataset: Any, consumed: ConsumedSet) -> None:
    """Shards are known by their URL as written: the same files named another way (a relative path,
    another mount point) match nothing, and their samples would be read again."""
    stages = getattr(dataset, "pipeline", [])
    urls = next((set(stage.urls) for stage in stages if isinstance(stage, UrlList)), None)
    recorded = set(consumed.samples) | set(consumed.tokens)
    if urls is None or not recorded or recorded & urls:
        return
    example = sorted(recorded)[0]
    logger.warning(
        "none of the %d shards the ledger recorded (e.g. %s) is among this pipeline's shard URLs (e.g. %s): "
        "shards are matched by URL as written, so their consumed samples will be read again; name the shards "
        "as the earlier runs did",
        len(recorded),
        example,
        sorted(urls)[0] if urls else "-",
    )


def _continue_counters(loader: Any, state: Any, epoch: int) -> None:
    """A loader that repeats (``repeat(n)``/``with_epoch`` on it) goes on counting its epochs as the
    saved run did: it would otherwise run ``n`` more epochs from the resumed one, or stop after an
    empty resumed epoch."""
    if getattr(loader, "repetitions", 1) != 1 and hasattr(loader, "continue_iteration") and state_epoch(state) == epoch:
        loader.continue_iteration(state)


def _set_epoch(loader: Any, epoch: int) -> None:
    for target in (loader, _dataset_of(loader)):
        set_epoch = getattr(target, "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)


def _draws_with_replacement(dataset: Any, depth: int = 0) -> bool:
    """Whether ``dataset``, or a dataset nested in it, draws its shards with replacement (``resampled=True``)."""
    if getattr(dataset, "draws_with_replacement", False):
        return True
    if dataset is None or depth > 8:
        return False
    nested = [*(getattr(dataset, "pipeline", None) or ()), *(getattr(dataset, "datasets", None) or ())]
    return any(_draws_with_replacement(part, depth + 1) for part in nested if part is not dataset)
