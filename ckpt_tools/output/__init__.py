"""The ``--out`` lifecycle: output directories appear only when complete, and nothing of the user's is ever deleted by
mistake.

One object owns the output: :class:`~.stage.Output` (``--out`` as given, its kind, overwrite rule, the inputs it must
not touch, the error class for a refused one; while staged its :class:`~.stage.Lock`, our ``OUT.partial-PID`` and
the directory written into), with the lifecycle as its methods, called in this order by the conversion driver:
``check()`` (:mod:`~ckpt_tools.output.guard`), ``stage()``, then ``publish()`` or ``discard()``
(:mod:`~ckpt_tools.output.stage`, with :mod:`~ckpt_tools.output.owner`: the ownership record in every directory we
create beside OUT, and the removal of what dead runs left):

* ``check()`` (:func:`~.guard.check_out`) validates ``--out`` before any work: not empty, a name the file system
  can hold with our suffixes, not a symlink or a file, its parent exists, not the current directory or one above
  it, not equal to / an ancestor of / inside any input (realpaths); an existing ``--out`` is replaced only with
  ``--overwrite`` and only when it is a checkpoint of the kind being written (for torch_dist also one
  ckpt-tools wrote: its sidecar) or an empty directory, holding no file we would not write
  (:func:`~.guard.foreign_files`: not in its manifest, or without one not named like ours): otherwise refused.
* ``stage()`` takes ``OUT.lock`` (a :class:`~.stage.Lock`: created already locked with ``flock`` and holding our
  record, linked into place: never opened for writing when it exists, so a symlink or a user's file there is left intact
  and refused; one writer per OUT at a time; the kernel drops the flock when the process dies), removes the
  stale ``OUT.partial-*`` / ``OUT.old-*`` dirs of dead runs - only those holding our ownership record
  (:data:`~.owner.MARKER`: pid, host, boot id, process start time) - re-checks OUT and creates
  ``OUT.partial-PID/`` (record inside) to write ``OUT.partial-PID/<name>`` in.
* ``publish()`` renames the finished dir into place with ``renameat2(RENAME_NOREPLACE)`` (a directory that
  appeared at OUT meanwhile is never replaced: without ``--overwrite`` the run fails and our output is kept as
  ``OUT.conflict-PID``); with ``--overwrite`` the old OUT is re-checked, moved to ``OUT.old-PID/prev`` (record
  inside), and removed only after the rename. ``discard()`` removes our partial dir after a failure; both
  release the lock, removing ``OUT.lock`` only while it is still the file we created.
"""
