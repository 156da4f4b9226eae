"""The streaming copy every conversion runs on: what it executes, planned without touching a file
(:mod:`~ckpt_tools.copy.plan`: records, ops, blocks, units), the executor (:mod:`~ckpt_tools.copy.engine`) and its
file I/O (:mod:`~ckpt_tools.copy.fileio`), and the base class of every output format
(:mod:`~ckpt_tools.copy.destination`)."""
