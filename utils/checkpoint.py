"""Checkpoints that never lose work.

What a checkpoint holds: accelerate's save_state (weights, optimizers, the registered schedulers,
every rank's RNG states), trainer_state.json (the step, from which the data position follows,
the skipped-update counts, controller state such as PPO's kl_coef, and what the data order
depends on), and manifest.json, written last: every file's name, size and CRC-32 (per 256 MiB
block), the number of processes and of models/optimizers/schedulers saved.

- Saving: all ranks write into checkpoint-<step>.tmp; the files are checksummed (the blocks shared
  out over ranks and threads) and flushed to disk (fsync); the manifest is written last; the
  folder is renamed into place; only then are checkpoints beyond --save_total_limit removed (each
  renamed away first, so a crash never leaves a half-deleted one). A failed write (disk full,
  permission) stops the run with one line naming the path and errno; the .tmp folder is removed.
- Trusting: a checkpoint is complete only when its manifest matches its files. `latest` is the
  newest complete one (damaged ones are named in one line and skipped); a named one that is damaged
  stops the run (exit 2). Checkpoints written before manifests existed are checked by structure
  (safetensors headers, the CRCs in torch's zip files, JSON, every rank's RNG file) instead.
- Resuming: every piece must come back exactly or the resume is refused (exit 2): the process
  count, the models/optimizers/schedulers, each rank's RNG states (checked after loading), the
  trainer state's keys, the seed/batch/dataset the data order depends on.
- Stopping: SIGTERM/SIGINT before training starts stop at once (exit 1, nothing trained); during
  training the current step finishes and is saved (exit 128 + signal); a second signal stops at
  once (exit 1). User code that fails mid-step (utils.cli.UserCodeError) first saves the state
  of the last finished step (--save_on_error), RNG states as they were at that step's end.
"""

import json
import os
import re
import shutil
import signal
import sys
import zlib
from contextlib import contextmanager

from utils.cli import UsageError, UserCodeError

MANIFEST = "manifest.json"  # written last: a checkpoint is complete when it matches the files
STATE_FILE = "trainer_state.json"
RNG_FILE = "random_states_{}.pkl"  # accelerate's name for rank {}'s RNG states
BLOCK_BYTES = 256 << 20  # one CRC-32 per block, so one large file is checked by several threads/ranks
_CHUNK = 16 << 20
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_LEFTOVER = re.compile(r"^checkpoint-\d+\.(tmp|deleting)$")  # interrupted saves and removals


class CheckpointError(Exception):
    """A damaged or incomplete checkpoint: one line, which file and what is wrong."""


def _say(message, file=sys.stdout):
    """Print once per machine (the line every rank would print)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(message, file=file, flush=True)


# ----------------------------------------------------------------------------------------------
# Checksums: CRC-32 (zlib, in every Python), per block, blocks shared out over ranks and threads.
# 2.8 GiB/s per thread on this machine's CPU (xxh3 9.5, sha256 1.4); zlib drops the GIL.


def _files_under(folder):
    names = []
    for root, _, files in os.walk(folder):
        for name in files:
            names.append(os.path.relpath(os.path.join(root, name), folder))
    return sorted(n for n in names if n != MANIFEST)


def _blocks(size, block_bytes=None):
    block_bytes = block_bytes or BLOCK_BYTES
    return [(offset, min(block_bytes, size - offset)) for offset in range(0, size, block_bytes)] or [(0, 0)]


def _crc_of_block(path, offset, length, sync=False):
    crc, buffer = 0, bytearray(min(_CHUNK, max(length, 1)))
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < length:
            view = memoryview(buffer)[:min(_CHUNK, length - done)]
            n = os.preadv(fd, [view], offset + done)
            if n == 0:
                break  # the file is shorter than it should be: the CRC will not match
            crc = zlib.crc32(view[:n], crc)
            done += n
        if sync:  # flush the file's data to the disk (once per file, with its first block)
            os.fsync(fd)
    finally:
        os.close(fd)
    return crc


def _all_ranks(accelerator, obj):
    """[obj of rank 0, obj of rank 1, ...]."""
    if accelerator is None or accelerator.num_processes == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * accelerator.num_processes
    dist.all_gather_object(out, obj)
    return out


class ReadError(Exception):
    """A checkpoint file that could not be read back (one line, with the errno)."""


def _checksums(folder, sizes, accelerator=None, sync=False, progress=None, block_bytes=None):
    """{name: [crc32 per block]} for the files of `sizes` ({name: size}); each rank computes
    every num_processes-th block, in threads, and all ranks get the whole result."""
    from concurrent.futures import ThreadPoolExecutor

    rank, world = (0, 1) if accelerator is None else (accelerator.process_index, accelerator.num_processes)
    tasks = [(name, i, offset, length) for name in sorted(sizes)
             for i, (offset, length) in enumerate(_blocks(sizes[name], block_bytes))]
    mine = tasks[rank::world]
    threads = max(1, min(8, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    def run(task):
        name, i, offset, length = task
        crc = _crc_of_block(os.path.join(folder, name), offset, length, sync=sync and i == 0)
        if progress is not None:
            progress.update(length)
        return name, i, crc

    try:
        with ThreadPoolExecutor(threads) as pool:
            results, error = list(pool.map(run, mine)), None
    except OSError as e:  # every rank must reach the gather below, failed or not
        results, error = [], describe_write_error(e, folder)
    parts = _all_ranks(accelerator, (results, error))
    errors = [e for _, e in parts if e]
    if errors:
        raise ReadError(errors[0])
    crcs = {name: [None] * len(_blocks(sizes[name], block_bytes)) for name in sizes}
    for part, _ in parts:
        for name, i, crc in part:
            crcs[name][i] = crc
    return crcs



# ----------------------------------------------------------------------------------------------
# Verifying a checkpoint before it is trusted


def _layout(accelerator):
    """What accelerate's save_state writes and load_state expects, as counts."""
    return {"models": len(accelerator._models), "optimizers": len(accelerator._optimizers),
            "schedulers": len(accelerator._schedulers), "custom_objects": len(accelerator._custom_objects)}


def _own_crc(manifest):
    return zlib.crc32(json.dumps({k: v for k, v in manifest.items() if k != "manifest_crc32"},
                                 sort_keys=True).encode())


def read_manifest(path):
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        if manifest["manifest_crc32"] != _own_crc(manifest):
            raise CheckpointError(f"{manifest_path} is damaged (its own checksum does not match)")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{manifest_path} is damaged (not a complete manifest)")
    return manifest


def verify_checkpoint(path, num_processes, accelerator=None):
    """Raise CheckpointError (one line: which file, what is wrong) unless `path` is a complete
    checkpoint that `num_processes` processes can resume from exactly. Every rank of `accelerator`
    calls it and gets the same answer."""
    has_manifest = os.path.isfile(os.path.join(path, MANIFEST))
    has_state = os.path.isfile(os.path.join(path, STATE_FILE))
    if not has_manifest and not has_state:
        raise CheckpointError(f"{path} has no {MANIFEST}: an interrupted save, not a checkpoint")
    if not has_manifest:
        try:
            with open(os.path.join(path, STATE_FILE)) as f:
                saved_with_manifest = json.load(f).get("saved_with_manifest")
        except (OSError, ValueError, AttributeError):
            saved_with_manifest = False  # unreadable: the structure check below names it
        if saved_with_manifest:
            raise CheckpointError(f"{os.path.join(path, MANIFEST)} is missing (this checkpoint was saved with one)")
        return _verify_without_manifest(path, num_processes)
    manifest = read_manifest(path)
    files = manifest["files"]
    saved_by = manifest["num_processes"]
    for name in [STATE_FILE] + [RNG_FILE.format(r) for r in range(saved_by)]:
        if name not in files:
            raise CheckpointError(f"{path}: its manifest does not list {name}, which a resume needs")
    if saved_by != num_processes:
        raise CheckpointError(
            f"{path} was saved by {saved_by} process(es) and this run has {num_processes}: each process's RNG "
            f"states and data share come back only with the same count (launch {saved_by})")
    sizes = {}
    for name, entry in files.items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise CheckpointError(f"{file_path} is missing")
        size = os.path.getsize(file_path)
        if size != entry["size"]:
            raise CheckpointError(f"{file_path} is {size} bytes, its manifest says {entry['size']} "
                                  "(truncated or changed)")
        sizes[name] = size
    progress = None
    total = sum(sizes.values())
    if total > (1 << 30) and (accelerator is None or accelerator.is_main_process):
        from tqdm.auto import tqdm

        progress = tqdm(total=total, unit="B", unit_scale=True, desc=f"checking {os.path.basename(path)}")
    try:
        crcs = _checksums(path, sizes, accelerator, progress=progress, block_bytes=manifest["block_bytes"])
    except ReadError as e:
        raise CheckpointError(f"{path}: cannot be read: {e}")
    if progress is not None:
        progress.close()
    for name in sorted(files):
        for i, (expected, got) in enumerate(zip(files[name]["crc32"], crcs[name])):
            if expected != got:
                offset, length = _blocks(sizes[name], manifest["block_bytes"])[i]
                raise CheckpointError(f"{os.path.join(path, name)}: bytes {offset}-{offset + length - 1} do not match "
                                      "their checksum (the file was damaged after it was saved)")


def _check_safetensors(file_path):
    import struct

    size = os.path.getsize(file_path)
    with open(file_path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{file_path} is {size} bytes: not a safetensors file (truncated or empty)")
        (header_len,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise CheckpointError(f"{file_path}: its safetensors header is damaged")
    end = max([t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"] or [0])
    if size != 8 + header_len + end:
        raise CheckpointError(f"{file_path} is {size} bytes, its header needs {8 + header_len + end} (truncated)")


def _check_zip(file_path):
    """torch.save writes a zip archive with a CRC-32 per record: read them all back."""
    import zipfile

    try:
        with zipfile.ZipFile(file_path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{file_path}: not a complete torch.save archive ({e})")
    if bad is not None:
        raise CheckpointError(f"{file_path}: record {bad} fails its CRC")


def _verify_without_manifest(path, num_processes):
    """Checkpoints saved before manifest.json existed: every file checked by its own structure,
    and the files a resume needs present."""
    names = _files_under(path)
    for name in names:
        file_path = os.path.join(path, name)
        if name.endswith(".safetensors"):
            _check_safetensors(file_path)
        elif name.endswith((".bin", ".pkl", ".pt", ".pth")):
            _check_zip(file_path)
        elif name.endswith(".json"):
            try:
                with open(file_path) as f:
                    json.load(f)
            except ValueError:
                raise CheckpointError(f"{file_path} is not valid JSON (truncated or empty)")
        else:
            raise CheckpointError(f"{path} has no {MANIFEST} (saved by an earlier version) and {name} cannot be "
                                  "checked without one; resume from a checkpoint with a manifest")
    rng_files = sorted(n for n in names if re.fullmatch(r"random_states_\d+\.pkl", n))
    for r in range(num_processes):
        if RNG_FILE.format(r) not in names:
            raise CheckpointError(f"{os.path.join(path, RNG_FILE.format(r))} is missing (rank {r}'s RNG states; "
                                  "deleted, or saved by fewer processes)")
    if len(rng_files) != num_processes:
        raise CheckpointError(f"{path} was saved by {len(rng_files)} process(es) and this run has {num_processes}: "
                              f"launch {len(rng_files)}")
    models = [n for n in names if re.fullmatch(r"(model|pytorch_model)(_\d+)?\.(safetensors|bin)", n)]
    optimizers = [n for n in names if re.fullmatch(r"optimizer(_\d+)?\.bin", n)]
    schedulers = [n for n in names if re.fullmatch(r"custom_checkpoint_\d+\.pkl", n)]
    if not models or len(optimizers) != len(models) or len(schedulers) != len(models):
        raise CheckpointError(f"{path}: {len(models)} model, {len(optimizers)} optimizer and {len(schedulers)} "
                              "scheduler files; each trained model needs all three (one was deleted?)")


# ----------------------------------------------------------------------------------------------
# Finding the checkpoint to resume from (before any model loads)


def list_checkpoints(output_dir):
    """checkpoint-<step> folders in `output_dir`, oldest first: [(step, path)], complete or not
    (verify_checkpoint tells); .tmp folders (interrupted saves) are never listed."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        if match and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(match.group(1)), os.path.join(output_dir, name)))
    return sorted(found)


def newest_complete(output_dir, exclude=None):
    """The newest checkpoint whose manifest lists files of the right sizes (no checksums: cheap,
    for messages), or None."""
    for _, path in reversed(list_checkpoints(output_dir)):
        if exclude and os.path.abspath(path) == os.path.abspath(exclude):
            continue
        try:
            files = read_manifest(path)["files"]
            if all(os.path.isfile(os.path.join(path, n)) and os.path.getsize(os.path.join(path, n)) == e["size"]
                   for n, e in files.items()):
                return path
        except (CheckpointError, OSError):
            continue
    return None


def resolve_resume(resume_from_checkpoint, output_dir, accelerator=None):
    """`latest` -> the newest complete checkpoint in output_dir (damaged ones reported and
    skipped); a path -> that checkpoint, if complete. Raises UsageError (exit 2) otherwise."""
    if resume_from_checkpoint is None:
        return None
    num_processes = 1 if accelerator is None else accelerator.num_processes
    if resume_from_checkpoint == "latest":
        skipped = []
        for _, path in reversed(list_checkpoints(output_dir)):
            try:
                verify_checkpoint(path, num_processes, accelerator)
            except CheckpointError as e:
                _say(f"warning: skipping a damaged checkpoint: {e}", file=sys.stderr)
                skipped.append(os.path.basename(path))
                continue
            _warn_if_unmanifested(path)
            return path
        raise UsageError(f"--resume_from_checkpoint latest: no complete checkpoint in --output_dir {output_dir}"
                         + (f" ({', '.join(skipped)} damaged, see above)" if skipped else ""))
    path = resume_from_checkpoint
    if not os.path.isdir(path):
        raise UsageError(f"--resume_from_checkpoint {path}: no such folder")
    try:
        verify_checkpoint(path, num_processes, accelerator)
    except CheckpointError as e:
        newest = newest_complete(os.path.dirname(os.path.abspath(path)), exclude=path)
        raise UsageError(f"--resume_from_checkpoint {path}: not a complete checkpoint: {e}"
                         + (f" (complete: {newest}, or use latest)" if newest else ""))
    _warn_if_unmanifested(path)
    return path


def _warn_if_unmanifested(path):
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        _say(f"warning: {path} has no {MANIFEST} (saved by an earlier version): its files were checked by their "
             "structure (headers, zip CRCs) instead of checksums", file=sys.stderr)


# ----------------------------------------------------------------------------------------------
# Saving


class SaveError(Exception):
    """A write that failed while saving: one line naming the path and the errno."""


def _testing_faults(point, step, folder):
    """Testing aids (tests/test_faults.py). LEAN_RL_KILL_AT=<point>:<step> kills rank 0 (SIGKILL)
    at that point of that step's save: state_written (accelerate's files written, no manifest),
    manifest_written (before the rename), renamed (before older checkpoints are pruned), pruning
    (an old checkpoint renamed away, not yet deleted). LEAN_RL_FAKE_SAVE_ERROR=<errno>:<step>
    makes that step's save fail with that errno after optimizer.bin was half written."""
    if os.environ.get("LEAN_RL_KILL_AT") == f"{point}:{step}" and os.environ.get("LOCAL_RANK", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    fake = os.environ.get("LEAN_RL_FAKE_SAVE_ERROR", "")
    if point == "state_written" and fake.endswith(f":{step}") and os.environ.get("LOCAL_RANK", "0") == "0":
        code = int(fake.split(":")[0])
        victim = os.path.join(folder, "optimizer.bin")
        if os.path.isfile(victim):
            os.truncate(victim, os.path.getsize(victim) // 2)
        raise OSError(code, f"{os.strerror(code)} (injected by LEAN_RL_FAKE_SAVE_ERROR)", victim)  # 13: PermissionError


def _newest_file(folder):
    files = [os.path.join(folder, n) for n in _files_under(folder)] if os.path.isdir(folder) else []
    return max(files, key=os.path.getmtime) if files else folder


def describe_write_error(exc, folder) -> str:
    """`[Errno 28] No space left on device: <path>` for any failure of a write into `folder`.
    torch.save's own writer loses the errno ("unexpected pos ..."): a small probe write into the
    folder then finds it (the disk is still full); the path is the file being written last."""
    import errno as errno_names

    code, path = None, None
    if isinstance(exc, OSError) and exc.errno:
        code, path = exc.errno, exc.filename
    else:
        match = re.search(r"code: (\d+)", str(exc))  # safetensors: IoError(Os { code: 28, ... })
        if match:
            code = int(match.group(1))
        elif os.path.isdir(folder):
            probe = os.path.join(folder, ".write-probe")
            try:
                with open(probe, "wb") as f:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                code = e.errno
            finally:
                if os.path.exists(probe):
                    os.remove(probe)
    path = path or _newest_file(folder)
    if code is None:
        first = (str(exc).strip().splitlines() or [""])[0]
        return f"{type(exc).__name__} ({first}) writing {path}"
    return f"[Errno {code} {errno_names.errorcode.get(code, '?')}] {os.strerror(code)}: {path}"


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _remove_checkpoint(path, step=None):
    """Renamed away first, so a crash never leaves a half-deleted checkpoint-<step>."""
    doomed = path + ".deleting"
    os.replace(path, doomed)
    _testing_faults("pruning", step, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _first_error(accelerator, error):
    """The first rank's error message (or None on every rank when none failed)."""
    errors = [e for e in _all_ranks(accelerator, error) if e]
    return errors[0] if errors else None


def save_checkpoint(accelerator, output_dir, step, trainer_state, save_total_limit=None):
    """Save everything needed to resume after `step` as output_dir/checkpoint-<step> (see the
    module docstring). Returns its path; raises SaveError on every rank if a write failed on any
    (the .tmp folder removed, older checkpoints untouched)."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    is_main = accelerator.is_main_process

    def attempt(action):
        try:
            action()
            return None
        except ReadError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - every write failure becomes one line
            return describe_write_error(e, tmp)

    def fail_if_any(error):
        error = _first_error(accelerator, error)
        if error:
            if is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            accelerator.wait_for_everyone()
            raise SaveError(error)

    def make_tmp():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)

    fail_if_any(attempt(make_tmp) if is_main else None)
    accelerator.wait_for_everyone()

    def write_state():
        accelerator.save_state(tmp)
        _testing_faults("state_written", step, tmp)
        if is_main:
            _write_json(os.path.join(tmp, STATE_FILE), dict(trainer_state, step=step, saved_with_manifest=True))
            for tracker in accelerator.trackers:  # the tracker's rows up to this step reach the disk
                getattr(getattr(tracker, "writer", None), "flush", lambda: None)()

    fail_if_any(attempt(write_state))
    accelerator.wait_for_everyone()
    sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in _files_under(tmp)}
    crcs = {}

    def checksum():
        crcs.update(_checksums(tmp, sizes, accelerator, sync=True))

    fail_if_any(attempt(checksum))

    def publish():
        manifest = {"format": 1, "step": step, "num_processes": accelerator.num_processes,
                    "layout": _layout(accelerator), "checksum": "crc32", "block_bytes": BLOCK_BYTES,
                    "files": {name: {"size": sizes[name], "crc32": crcs[name]} for name in sorted(sizes)}}
        manifest["manifest_crc32"] = _own_crc(manifest)
        _fsync_dir(tmp)
        _write_json(os.path.join(tmp, MANIFEST), manifest)
        _testing_faults("manifest_written", step, tmp)
        if os.path.exists(final):  # a stale checkpoint of this step (an earlier run in this output_dir)
            _remove_checkpoint(final)
        os.replace(tmp, final)
        _fsync_dir(output_dir)
        _testing_faults("renamed", step, final)

    fail_if_any(attempt(publish) if is_main else None)
    if is_main and save_total_limit:
        older = [p for s, p in list_checkpoints(output_dir) if s < step]
        for old in older[:max(0, len(older) - (save_total_limit - 1))]:
            _remove_checkpoint(old, step)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path):
    """Restore what save_checkpoint wrote (checked by resolve_resume first); returns the trainer
    state (with `step`). Raises CheckpointError when something would not come back exactly."""
    import torch

    manifest = read_manifest(path) if os.path.isfile(os.path.join(path, MANIFEST)) else None
    if manifest is not None and manifest.get("layout") != _layout(accelerator):
        def counts(layout):
            return ", ".join(f"{v} {k}" for k, v in layout.items())

        raise CheckpointError(f"it holds {counts(manifest.get('layout', {}))} and this run has "
                              f"{counts(_layout(accelerator))}: saved by the other script or another setup")
    accelerator.load_state(path)
    # accelerate skips RNG states it cannot load without a word: check they came back
    states = torch.load(os.path.join(path, RNG_FILE.format(accelerator.process_index)), weights_only=False)
    restored = torch.equal(torch.get_rng_state(), states["torch_manual_seed"])
    if torch.cuda.is_available():
        if "torch_cuda_manual_seed" not in states:
            raise CheckpointError(f"{path} was saved without CUDA RNG states (on a CPU) and this run samples on CUDA")
        restored &= all(torch.equal(a, b)
                        for a, b in zip(torch.cuda.get_rng_state_all(), states["torch_cuda_manual_seed"]))
    if not restored:
        rng_file = os.path.join(path, RNG_FILE.format(accelerator.process_index))
        raise CheckpointError(f"{rng_file}: the RNG states did not load")
    with open(os.path.join(path, STATE_FILE)) as f:
        return json.load(f)


def save_pretrained_atomic(accelerator, model, tokenizer, path):
    """The trained model as one folder that `from_pretrained` loads, written atomically. A LoRA
    model is merged into its base weights first (so call this last). Raises SaveError."""
    unwrapped = accelerator.unwrap_model(model)
    if hasattr(unwrapped, "merge_and_unload"):  # PEFT
        unwrapped = unwrapped.merge_and_unload()
        state_dict = unwrapped.state_dict()
    else:
        state_dict = accelerator.get_state_dict(model)
    error = None
    if accelerator.is_main_process:
        tmp = path + ".tmp"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001
            error = describe_write_error(e, tmp)
            shutil.rmtree(tmp, ignore_errors=True)
    error = _first_error(accelerator, error)
    accelerator.wait_for_everyone()
    if error:
        raise SaveError(error)


# ----------------------------------------------------------------------------------------------
# Signals and user code failures


class StopSignal:
    """SIGTERM/SIGINT, from the script's first lines on (install()). Before training starts
    nothing has been trained: the run stops at once, exit 1 (128 + signal means "saved"). Once
    armed (the loop is about to run), the first signal asks for a save at the end of the current
    step, then exit 128 + signal; a second stops at once, unsaved, exit 1."""

    installed = None

    @classmethod
    def install(cls):
        if cls.installed is None:
            cls.installed = cls()
        return cls.installed

    def __init__(self):
        self.signum = 0
        self.armed = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame):
        if not self.armed:
            _say(f"received signal {signum} during setup, before any step: stopped, nothing trained, nothing saved "
                 "(exit code 1)", file=sys.stderr)
            # at once, not sys.exit: its SystemExit would rise from whatever frame the signal interrupted (an
            # import 1 s in), where library code may catch or wrap it (CI once printed a RecursionError's
            # traceback). Nothing is trained or open for writing yet
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        if self.signum:
            _say(f"received signal {signum} again: stopped at once, the current step is not saved (exit code 1); "
                 "the newest complete checkpoint is kept", file=sys.stderr)
            sys.exit(1)
        self.signum = signum
        _say(f"received signal {signum}: finishing this step, then saving (a second signal stops at once)",
             file=sys.stderr)

    def requested(self, accelerator) -> int:
        """The signal number if any rank received one, else 0 (one tiny all-reduce per step)."""
        if accelerator.num_processes == 1:
            return self.signum
        import torch

        flag = torch.tensor([self.signum], device=accelerator.device)
        return int(accelerator.gather(flag).max().item())


def _rng_states():
    import random

    import numpy as np
    import torch

    states = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states):
    import random

    import numpy as np
    import torch

    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def _updates_done(accelerator):
    """Changes with every optimizer step: the step counts of the schedulers (registered or prepared)."""
    objects = list(accelerator._custom_objects) + [getattr(s, "scheduler", s) for s in accelerator._schedulers]
    return tuple(getattr(o, "last_epoch", None) for o in objects)


class Checkpointer:
    """The run's saving policy: a fresh or resumed start, a checkpoint every `save_steps`, one on
    SIGTERM/SIGINT (then the caller exits), one when user code fails (`save_on_error`, then exit
    1), and one at the end; nothing with enabled=False (--save_strategy no). A write that fails
    stops the run (exit 1) with one line."""

    def __init__(self, accelerator, output_dir, save_steps, save_total_limit, enabled=True, save_on_error=True):
        self.accelerator = accelerator
        self.enabled = enabled
        self.output_dir = output_dir
        self.save_steps = save_steps
        self.save_total_limit = save_total_limit
        self.save_on_error = save_on_error
        self.stop = StopSignal.install()
        self.saved_step = None  # the step of the checkpoint this run saved or resumed last
        self.data_position = {}
        self.trainer_state = {}
        self.step = 0

    def _exit(self, code, message, file=sys.stderr):
        if self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            tqdm.write(message, file=file)  # on a line of its own, not after the progress bar
        self.accelerator.wait_for_everyone()  # no rank leaves first (a launcher stops the others when one does)
        self.accelerator.end_training()  # trackers closed, the process group torn down
        sys.exit(code)

    def start(self, resume_path, defaults, data_position=None) -> dict:
        """Restore `resume_path` (-> its trainer state) or prepare a fresh output_dir (->
        `defaults`). A resumed state must hold every key of `defaults` and the same
        `data_position` (what the data order depends on), or the run stops (exit 2)."""
        from utils.cli import fail

        self.data_position = dict(data_position or {})
        if self.accelerator.is_main_process:
            os.makedirs(self.output_dir, exist_ok=True)  # a resumed run may write to a new output_dir
            leftovers = [n for n in os.listdir(self.output_dir) if _LEFTOVER.match(n)]
            for name in leftovers:  # interrupted saves or removals (kill -9, power loss)
                shutil.rmtree(os.path.join(self.output_dir, name), ignore_errors=True)
            if leftovers:
                print(f"removed {', '.join(leftovers)} from {self.output_dir} (left by an interrupted run)", flush=True)
        state = dict(defaults)
        if resume_path:
            try:
                state = load_checkpoint(self.accelerator, resume_path)
            except CheckpointError as e:
                fail(f"--resume_from_checkpoint {resume_path}: {e}")
            except Exception as e:  # noqa: BLE001 - verified files that still do not load (another version?)
                fail(f"--resume_from_checkpoint {resume_path}: loading failed: {type(e).__name__}: "
                     f"{(str(e).strip().splitlines() or [''])[0]}")
            if "skipped_in_a_row" in defaults and "skipped_in_a_row" not in state and state.get("total_skipped") == 0:
                state["skipped_in_a_row"] = 0  # saved before it was recorded; exact: nothing was ever skipped
            missing = [k for k in defaults if k not in state]
            if missing:
                fail(f"--resume_from_checkpoint {resume_path}: its {STATE_FILE} lacks {', '.join(missing)}, so the run "
                     "could not continue exactly (saved by the other script, or an earlier version?)")
            saved = state.get("data_position", self.data_position)  # absent: saved before it was recorded
            for key, value in self.data_position.items():
                if key in saved and saved[key] != value:
                    fail(f"--resume_from_checkpoint {resume_path}: it was saved with {key} {saved[key]} and this run "
                         f"has {value}; the data order depends on it, so the run would not continue where it stopped")
            self.saved_step = state["step"]
        elif self.accelerator.is_main_process and list_checkpoints(self.output_dir):
            import warnings

            warnings.warn(f"{self.output_dir} already holds checkpoints; this run starts from scratch "
                          "(use --resume_from_checkpoint latest to continue)")
        self.accelerator.wait_for_everyone()
        self.step = state.get("step", 0)
        self.trainer_state = {k: state[k] for k in defaults}
        self.stop.armed = True  # from here on a signal saves first
        return state

    def begin_step(self, step):
        """Call first in every step: the RNG states as they are now (= at the end of the previous
        step) are what a save after a failure in this step must hold."""
        self.step = step
        self.rng_at_step_start = _rng_states()
        self.updates_at_step_start = _updates_done(self.accelerator)

    def save_model(self, model, tokenizer):
        """The final model as output_dir/final (from_pretrained-loadable); returns its path, or None
        when saving is off."""
        if not self.enabled:
            return None
        path = os.path.join(self.output_dir, "final")
        try:
            save_pretrained_atomic(self.accelerator, model, tokenizer, path)
        except SaveError as e:
            self._exit(1, f"error: could not save the final model: {e}; {path}.tmp removed; the last checkpoint "
                          f"{newest_complete(self.output_dir) or '(none)'} holds the same weights")
        return path

    def save(self, step, trainer_state):
        if not self.enabled:
            return None
        final = os.path.join(self.output_dir, f"checkpoint-{step}")
        if step == self.saved_step and os.path.isdir(final):
            return final  # this state is saved already (e.g. a signal right after a periodic save)
        trainer_state = dict(trainer_state, data_position=self.data_position)
        try:
            path = save_checkpoint(self.accelerator, self.output_dir, step, trainer_state, self.save_total_limit)
        except SaveError as e:
            newest = newest_complete(self.output_dir)
            self._exit(1, f"error: could not save checkpoint-{step}: {e}; checkpoint-{step}.tmp removed; "
                          + (f"the newest complete checkpoint, {newest}, is untouched (free the space or fix the "
                             "permission, then resume with --resume_from_checkpoint latest)" if newest
                             else "no earlier checkpoint to resume from"))
        self.saved_step = step
        return path

    def after_step(self, done, max_steps, trainer_state) -> int:
        """Save if it is time; on a signal save and return its number (the caller exits)."""
        self.trainer_state = dict(trainer_state)
        if self.save_steps and done % self.save_steps == 0 and done < max_steps:
            self.save(done, trainer_state)
        signum = self.stop.requested(self.accelerator)
        if signum:
            path = self.save(done, trainer_state)
            if self.accelerator.is_main_process:
                launcher = (" (under accelerate launch, the launcher itself then exits 1 with torch's SignalException: "
                            "the checkpoint is complete)" if os.environ.get("TORCHELASTIC_RUN_ID") else "")
                print(f"\nreceived signal {signum}: " + (f"saved {path}; resume with --resume_from_checkpoint latest"
                                                        if path else "nothing saved (--save_strategy no)")
                      + f"; every process exits {128 + signum}{launcher}", flush=True)
        return signum

    @contextmanager
    def user_code(self):
        """Around calls into the user's code (reward functions, reward models): a UserCodeError
        on any rank ends the run on every rank, after saving the state of the last finished step
        (save_on_error; RNG states as they were when this step began), exit 1."""
        error = None
        try:
            yield
        except UserCodeError as e:
            error = e
        failed = [0] if error is not None else []
        if self.accelerator.num_processes > 1:  # one tiny all-gather per step: did any rank fail?
            import torch

            flags = self.accelerator.gather(torch.tensor([error is not None], device=self.accelerator.device))
            failed = [r for r, f in enumerate(flags.tolist()) if f]
        if not failed:
            return
        import traceback

        if error is not None:
            from tqdm.auto import tqdm

            for bar in list(getattr(tqdm, "_instances", ())):  # the progress bar ends before the block, not in it
                bar.close()
            prefix = f"[rank {self.accelerator.process_index}] " if self.accelerator.num_processes > 1 else ""
            lines = [f"{prefix}error: {error}"]
            own = getattr(error, "user_traceback", "")  # the user's frames only (utils/rewards.py)
            if own:
                lines.append(own.rstrip("\n"))
            elif error.__cause__ is not None and "Traceback" not in str(error):
                lines.append("".join(traceback.format_exception(error.__cause__)).rstrip())
            print("\n".join(lines), file=sys.stderr, flush=True)
        done = self.step  # finished steps
        if not self.enabled or not self.save_on_error:
            newest = newest_complete(self.output_dir) if self.enabled else None
            why = "--save_strategy no" if not self.enabled else "--save_on_error false"
            self._exit(1, f"step {done + 1} failed in user code; nothing saved ({why})"
                          + (f"; the newest complete checkpoint: {newest}" if newest else ""))
        if done == 0:
            self._exit(1, "step 1 failed in user code; nothing saved (no step had finished); fix it and start again")
        if _updates_done(self.accelerator) != self.updates_at_step_start:
            newest = newest_complete(self.output_dir)
            self._exit(1, f"step {done + 1} failed in user code after its update; its state is not that of a finished "
                          f"step, so nothing is saved; the newest complete checkpoint: {newest or '(none)'}")
        _set_rng_states(self.rng_at_step_start)  # the RNGs as step `done` left them, before this step's sampling
        path = self.save(done, self.trainer_state)
        self._exit(1, f"step {done + 1} failed in user code (rank {', '.join(map(str, failed))}); saved {path}, the "
                      f"state after step {done}: fix the code, then resume with --resume_from_checkpoint {path}")
