"""Test-only launcher: run a script under accelerate's FSDP2 on CPU processes (gloo).

accelerate 1.15 keeps FSDP for GPU-like devices only (state.py drops the FSDP plugin on
MULTI_CPU), though torch's fully_shard runs on CPU. This sets the distributed type back to FSDP
after accelerate's own setup, so the scripts' FSDP2 paths (sharded training, gathering for
generation, sharded checkpoints, the gathered final save) run in CI without a GPU. Usage:
    ACCELERATE_USE_CPU=true ACCELERATE_USE_FSDP=true FSDP_VERSION=2 ... \\
        accelerate launch --multi_gpu --num_processes 2 ... tests/fsdp_on_cpu.py train_grpo.py ARGS
"""
import os
import runpy
import sys

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

_init = AcceleratorState.__init__


def _init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)

    if fsdp_plugin is not None and self.distributed_type in (DistributedType.MULTI_CPU, DistributedType.NO):
        self.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # copied back by later inits
        self.fsdp_plugin = fsdp_plugin
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)


AcceleratorState.__init__ = _init_keeping_fsdp
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as if the script were run itself
runpy.run_path(script, run_name="__main__")
