"""Structural maps: where every element of a refactored model's tensors comes from.

Framework-neutral, beside the state model: :mod:`~statekit.structure.pieces` (the language: affine
pieces, target maps), :mod:`~statekit.structure.infer` (the map learned from the weights before and
after the user's conversion), :mod:`~statekit.structure.proof` and
:mod:`~statekit.structure.coverage` (checked before a byte moves), :mod:`~statekit.structure.rules`
(the same maps from ``--fuse``, ``--split``, ``--stack``, ``--unstack``) and
:mod:`~statekit.structure.apply` (optimizer state moved by a map). ``remap`` and ``convert`` use it.
"""
