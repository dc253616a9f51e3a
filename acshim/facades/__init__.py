"""Facades: one package per upstream API, at the upstream import path below ``acshim.facades``.

``import deepspeed`` becomes ``from acshim.facades import deepspeed``; ``import
smdistributed.modelparallel.torch as smp`` becomes ``import acshim.facades.smdistributed.modelparallel.torch
as smp``. Facades translate names, signatures, defaults, config keys and errors into engine calls and
hold no engine logic.
"""
