"""What a run left at its hook points: `ActivationCache`, name -> activation, and `cached`, a
lookup that names what is missing."""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Iterable, Iterator, Mapping

from torch import Tensor, nn

from glassgpt.errors import InputError


class MissingActivationError(InputError, KeyError):
    """A cache holds no activation under the name asked for (a KeyError too, as a Mapping's
    missing key is). The message names the missing point and the closest names held."""

    def __str__(self) -> str:  # KeyError's would quote the whole message
        return str(self.args[0])


class ActivationCache(Mapping[str, Tensor]):
    """Hook name -> the activation a run produced there (detached). A missing name raises
    MissingActivationError, saying which names the cache has. `ids` and `model` are the run's
    own (the model weakly held), so a reader can tell a cache of other tokens or another
    model from the one it was handed."""

    def __init__(self, tensors: dict[str, Tensor], ids: Tensor | None = None,
                 model: nn.Module | None = None):
        self._tensors = tensors
        self.ids = ids
        self._model = None if model is None else weakref.ref(model)

    @property
    def model(self) -> nn.Module | None:
        return None if self._model is None else self._model()

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._tensors:
            raise MissingActivationError(unknown_name_message(name, self._tensors, "this cache"))
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"ActivationCache({len(self)} activations)"


def cached(cache: Mapping[str, Tensor], name: str) -> Tensor:
    """cache[name] from an ActivationCache or a plain dict of tensors; a missing name raises
    MissingActivationError naming it (a dict's bare KeyError would name nothing)."""
    if name not in cache:
        raise MissingActivationError(unknown_name_message(name, cache, "the cache"))
    return cache[name]


def unknown_name_message(name: object, known: Iterable[str], where: str) -> str:
    known = list(known)
    close = difflib.get_close_matches(str(name), known, n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; it has {len(known)} names"
    return f"no hook point {name!r} in {where}{hint}"
