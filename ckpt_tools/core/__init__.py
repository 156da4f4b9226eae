"""The bottom layer: what every other package may use - the exit codes and exception bases (:mod:`.errors`), number
parsing (:mod:`.numbers`), paths in messages (:mod:`.show`), small files (:mod:`.files`), progress bars and byte budgets
(:mod:`.progress`), this host's boot id (:mod:`.host`), the test hold point (:mod:`.hold`) and the client releases
ckpt-tools writes for (:mod:`.clients`, ``--version``). It imports nothing else of ckpt_tools but its version."""
