"""Run configs: one hjson file (JSON with comments, unquoted keys, optional
commas) describing a training run — mesh, parallelism presets, optimizer,
schedule, precision, batch sizes, checkpointing, monitoring — parsed into
frozen attrs values with one source of defaults (the class fields), then
turned into calls: ``Mesh(...)``, ``rules.zero(...)``, ``optim.adamw(...)``.

>>> config = RunConfig.from_text('''
... // ZeRO-3 over every rank, 16 sequences a step
... mesh: {dp: -1}
... parallel: {zero: 3}
... optimizer: {type: "adamw", lr: 3e-3, weight_decay: 0.1}
... batch: {global: 16, micro: 4}
... ''')
>>> config.parallel.zero, config.optimizer.lr
(3, 0.003)
>>> config.batch.resolve(dp_size=2)
ResolvedBatch(global_size=16, micro=4, accumulation=2)

Unknown keys are errors that name the key, its place and the keys allowed
there; batch sizes that do not add up name all three and the world size.
"""

from ..errors import ConfigError as ConfigError
from ._deepspeed import from_deepspeed as from_deepspeed
from ._load import load_config as load_config
from ._run import RunConfig as RunConfig
from ._sections import BatchConfig as BatchConfig
from ._sections import CheckpointConfig as CheckpointConfig
from ._sections import MemoryConfig as MemoryConfig
from ._sections import MonitorConfig as MonitorConfig
from ._sections import OptimizerConfig as OptimizerConfig
from ._sections import ParallelConfig as ParallelConfig
from ._sections import PrecisionConfig as PrecisionConfig
from ._sections import ResolvedBatch as ResolvedBatch
from ._sections import ScheduleConfig as ScheduleConfig

__all__ = [
    "BatchConfig",
    "CheckpointConfig",
    "ConfigError",
    "MemoryConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "ResolvedBatch",
    "RunConfig",
    "ScheduleConfig",
    "from_deepspeed",
    "load_config",
]
