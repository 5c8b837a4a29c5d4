"""Test-only launcher: run a script under an accelerate config's engine (DeepSpeed ZeRO, FSDP2) on
CPU processes (gloo), so that CI tests the engines with several processes without a GPU.

accelerate 1.15 keeps DeepSpeed and FSDP for accelerators only: asked for CPU processes, state.py
sets up plain DDP (MULTI_CPU) and drops the engine's plugin, though DeepSpeed's ZeRO and torch's
fully_shard both run on CPU. This sets the distributed type back to the engine after accelerate's
own setup; everything else (the plugin from the config file, prepare, save_state) is accelerate's.

    accelerate launch --config_file accelerate_configs/fsdp2.yaml --num_processes 2 --mixed_precision no \\
        tests/engine_on_cpu.py train_grpo.py ARGS
"""
import os
import runpy
import sys

os.environ["ACCELERATE_USE_CPU"] = "true"  # the configs say use_cpu: false, which the launcher passes on

from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

_init = AcceleratorState.__init__


def _init_keeping_the_engine(self, *args, fsdp_plugin=None, deepspeed_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, deepspeed_plugin=deepspeed_plugin, **kwargs)
    if self.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.NO):
        return
    if deepspeed_plugin is not None:
        engine = DistributedType.DEEPSPEED
        deepspeed_plugin.set_mixed_precision(self._mixed_precision)
        deepspeed_plugin.select(_from_accelerator_state=True)
        self.deepspeed_plugins = deepspeed_plugin
    elif fsdp_plugin is not None:
        engine = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin
        if self._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self._mixed_precision)
    else:
        return
    self.distributed_type = engine
    PartialState._shared_state["distributed_type"] = engine  # later AcceleratorState() calls copy it back


AcceleratorState.__init__ = _init_keeping_the_engine
script, sys.argv = sys.argv[1], sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as if the script were run itself
runpy.run_path(script, run_name="__main__")
