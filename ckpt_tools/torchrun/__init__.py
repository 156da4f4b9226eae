"""Running on every rank of a ``torchrun`` job: the ranks, their store, agreement and heartbeat
(:mod:`~ckpt_tools.torchrun.ranks`), and how the work is divided among them (:mod:`~ckpt_tools.torchrun.divide`)."""
