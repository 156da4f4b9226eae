"""The jobs of ``scripts/device_check.py`` (issue 35; what each checks: that script's docstring), one module each:
:mod:`.digest` (1. the positional digest kernel on the device), :mod:`.delta` (2. the delta kernels),
:mod:`.sync` (3. the sync of a real megatron-core actor on the device, every method against the gather-all
baseline) and :mod:`.throughput` (4. each stage's throughput on the device, for ``plan --sync --calibrate``)."""
