"""What a replica in another process (``executor="process"``) or a Ray actor builds its
model from, and how that reaches it by pickle (:data:`ModelSource`): the function itself, a
factory called with the replica's device, a ``"module:attr"`` string naming such a factory,
or a :class:`FunctionRef` naming a decorated function (a ``@batched`` method's with the
instance it is called on, less the batchers the instance keeps).
"""

from __future__ import annotations

import copyreg
import dataclasses
import functools
import importlib
import pickle
from typing import Any

from carpool.core.replicas import BatchFn, FnFactory, is_async_callable
from carpool.errors import ConfigError

# What a process replica builds its model from: the function itself, a factory called
# with the replica's device, or a "module:attr" string naming such a factory.
ModelSource = tuple[BatchFn | None, FnFactory | str | None]

# The prefix of the instance attributes where a @batched method keeps its batcher.
BATCHED_ATTRIBUTE = "_carpool_batched_"


@dataclasses.dataclass(frozen=True, slots=True)
class FunctionRef:
    """A factory giving the function at ``module``'s ``qualname`` (unwrapped when it was
    decorated, as by ``@carpool.batched``): how a decorated function reaches a child,
    since pickle cannot name it while its decorator runs."""

    module: str
    qualname: str
    # What it is called with first: a decorated method's instance (``self``)
    args: tuple[Any, ...] = ()
    keywords: tuple[tuple[str, Any], ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:
        # The instance a method is called on, without the batchers it holds by now
        args = tuple(_detached(arg) for arg in self.args)
        return FunctionRef, (self.module, self.qualname, args, self.keywords)

    def __call__(self, device: str) -> BatchFn:
        found: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            found = getattr(found, part)
        fn: BatchFn = getattr(found, "__wrapped__", found)
        if self.args or self.keywords:
            return functools.partial(fn, *self.args, **dict(self.keywords))
        return fn


def process_source(
    fn: BatchFn | None, fn_factory: FnFactory | str | None, executor: str = "process"
) -> ModelSource:
    """What a child process (or a Ray actor) builds the model from; it must reach the
    child by pickle.

    Raises:
        ConfigError: ``fn`` async or not picklable, ``fn_factory`` not picklable.
    """
    if fn is not None and is_async_callable(fn):
        raise ConfigError("fn", fn, f"a sync function for executor={executor!r}")
    field, value = ("fn", fn) if fn is not None else ("fn_factory", fn_factory)
    if isinstance(value, str):
        if value.count(":") != 1 or not all(value.split(":")):
            raise ConfigError(field, value, "a 'module:attr' string naming a factory")
        return None, value
    try:
        pickle.dumps(value)
    except Exception as exc:
        if fn is not None and isinstance(value, functools.partial):
            # A decorated method: its function by name, its instance by pickle (the
            # partial's copied name alone gave the child the function without self).
            ref = process_source(value.func, None, executor)[1]
            if isinstance(ref, FunctionRef) and not (ref.args or ref.keywords):
                return None, _bound_ref(ref, value, field, executor)
        module = getattr(value, "__module__", None)
        qualname = getattr(value, "__qualname__", "<")
        if fn is not None and isinstance(module, str) and "<" not in qualname:
            return None, FunctionRef(module, qualname)  # decorated at a module's top level
        raise ConfigError(
            field,
            value,
            f"for executor={executor!r}, a picklable function (defined at a module's top "
            "level, not a lambda or a closure), or fn_factory as a picklable callable or "
            f"a 'module:attr' string naming one ({type(exc).__name__}: {exc})",
        ) from None
    return fn, fn_factory


def _bound_ref(
    ref: FunctionRef, bound: functools.partial[Any], field: str, executor: str
) -> FunctionRef:
    """``ref`` called with what ``bound`` passes first (a method's instance), which must
    reach the child by pickle too: its ``__dict__`` as pickle takes it by default, less the
    batchers (:func:`_detached`)."""
    for arg in bound.args:
        if hasattr(arg, "__dict__") and not _pickles_its_dict(type(arg)):
            raise ConfigError(
                field,
                bound,
                f"for executor={executor!r} on a method, an instance whose class pickles "
                f"its __dict__ as Python does by default ({type(arg).__name__} defines "
                "__reduce__, __getstate__ or __slots__; the child process calls the method "
                "on a copy of the instance, without the batchers kept in it)",
            )
    try:
        pickle.dumps((*(_detached(arg) for arg in bound.args), bound.keywords))
    except Exception as exc:
        raise ConfigError(
            field,
            bound,
            f"for executor={executor!r} on a method, an instance that pickles (the child "
            f"process calls the method on a copy of it; {type(exc).__name__}: {exc})",
        ) from None
    return FunctionRef(ref.module, ref.qualname, bound.args, tuple(bound.keywords.items()))


def _pickles_its_dict(cls: type) -> bool:
    """Whether pickle takes an instance of ``cls`` as its ``__dict__``, as for a plain
    class: what :func:`_detached` rebuilds."""
    klass: Any = cls
    plain = (
        klass.__reduce_ex__ is object.__reduce_ex__
        and klass.__reduce__ is object.__reduce__
        and klass.__getstate__ is object.__getstate__
    )
    return plain and not any("__slots__" in vars(klass) for klass in cls.__mro__)


def _detached(arg: Any) -> Any:
    """What pickles ``arg`` as it is, less the batchers ``@batched`` methods keep in its
    ``__dict__`` (they hold threads and the method itself: no pickle takes them, and the
    child has no use for them); ``arg`` itself is not touched. Asked when pickled, not when
    the reference is made: the batcher is stored in the instance after its source is."""
    state = getattr(arg, "__dict__", None)
    if not isinstance(state, dict) or not any(
        isinstance(k, str) and k.startswith(BATCHED_ATTRIBUTE) for k in state
    ):
        return arg
    kept = {
        k: v
        for k, v in state.items()
        if not (isinstance(k, str) and k.startswith(BATCHED_ATTRIBUTE))
    }
    return _Detached(type(arg), kept)


@dataclasses.dataclass(frozen=True, slots=True)
class _Detached:
    """An instance of ``cls`` with ``state`` as its ``__dict__``, once unpickled."""

    cls: type
    state: dict[str, Any]

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, (self.cls, self.state)


def _rebuilt(cls: type[Any], state: dict[str, Any]) -> Any:
    instance = copyreg.__newobj__(cls)  # type: ignore[attr-defined]  # as pickle does
    instance.__dict__.update(state)
    return instance


def build_from_source(source: ModelSource, device: str) -> BatchFn:
    """The model ``source`` gives on ``device`` (in a replica's process or Ray actor)."""
    fn, factory = source
    if fn is not None:
        return fn
    if isinstance(factory, str):
        module, attr = factory.split(":")
        factory = getattr(importlib.import_module(module), attr)
    assert factory is not None
    return factory(device)
