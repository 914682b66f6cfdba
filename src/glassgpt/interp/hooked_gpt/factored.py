"""A matrix kept as the product of two factors, M = A @ B, with TransformerLens's conventions.

A head's OV circuit W_V[h] @ W_O[h] and its QK circuit W_Q[h] @ W_K[h].T are (C, C) matrices of
rank at most d (the head size), and the full circuits W_E @ W_V[h] @ W_O[h] @ W_U are
(vocab, vocab): far too big to form, yet rank d. `FactoredMatrix(A, B)` keeps A (..., ldim, mdim)
and B (..., mdim, rdim) and answers questions about M = A @ B from the factors alone:

    norm        A = Qa Ra and B^T = Qb Rb (QR), so AB = Qa (Ra Rb^T) Qb^T; Qa and Qb have
                orthonormal columns, which keep the Frobenius norm: ||AB|| = ||Ra Rb^T||, a
                small matrix (at most mdim x mdim). No Gram matrix A^T A, whose rounding
                would blur a norm near 0.
    svd         A = Ua Sa Va^T and B = Ub Sb Vb^T, so AB = Ua (Sa Va^T Ub Sb) Vb^T. The middle is
                small (at most mdim x mdim); its SVD Um Sm Vm^T gives AB = (Ua Um) Sm (Vb Vm)^T,
                and Ua Um, Vb Vm still have orthonormal columns: that is AB's thin SVD.
    eigenvalues If BA v = k v then AB (A v) = A (BA v) = k (A v): AB and BA share their non-zero
                eigenvalues, and BA is only (mdim, mdim).

So each costs O(ldim mdim^2 + mdim^2 rdim), never O(ldim rdim). A product with a matrix stays
factored, keeping the smaller inner size: M @ X has the factors (A, B @ X) when rdim > mdim
(inner size mdim) and (AB, X) otherwise (inner size rdim, already the smaller); X @ M likewise
(X @ A, B) or (X, AB); a vector collapses the product to a vector. Leading (batch) dims
broadcast like torch.matmul's, so W_V (L, H, C, d) with W_O (L, H, d, C) is every head's OV
circuit at once, and `ov[1, 4]` indexes them without forming any product.

`svd()` returns (U, S, V) with M = U @ diag(S) @ V^T (V, not V^T: TransformerLens's convention),
U (..., ldim, k), S (..., k), V (..., rdim, k), k = min(ldim, mdim, rdim).
"""

from __future__ import annotations

import numbers
import warnings
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from glassgpt.errors import InputError

Scalar = int | float | Tensor


class FactoredIndexError(InputError, IndexError):
    """An index past a FactoredMatrix's end, or not an index at all (an IndexError too, so
    that iterating over the leading dim stops where it should)."""


class FactoredMatrix:
    """M = A @ B kept as its factors: A (..., ldim, mdim), B (..., mdim, rdim)."""

    def __init__(self, A: Tensor, B: Tensor) -> None:
        for name, factor in (("A", A), ("B", B)):
            if not isinstance(factor, Tensor) or factor.dim() < 2:
                got = tuple(factor.shape) if isinstance(factor, Tensor) else type(factor).__name__
                raise InputError(f"factor {name} must be a tensor of 2+ dims, got {got}")
            if not (factor.is_floating_point() or factor.is_complex()):
                raise InputError(f"factor {name} must hold floating-point (or complex) numbers, "
                                 f"got {factor.dtype}: its norm and SVD are not defined")
        check_same_kind(A, B, "the factors A and B")
        if A.shape[-1] != B.shape[-2]:
            raise InputError(f"factors do not chain: A {tuple(A.shape)} @ B {tuple(B.shape)} "
                             f"needs A's last dim to equal B's second to last")
        try:
            leading = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise InputError(f"the leading dims of A {tuple(A.shape)} and B {tuple(B.shape)} "
                             f"do not broadcast") from None
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.shape = leading + (self.ldim, self.rdim)
        self.has_leading_dims = A.dim() > 2 or B.dim() > 2
        # Both factors carry the full leading shape (a view, no copy), so indexing them alike
        # indexes M.
        self.A = A.broadcast_to(leading + (self.ldim, self.mdim))
        self.B = B.broadcast_to(leading + (self.mdim, self.rdim))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def pair(self) -> tuple[Tensor, Tensor]:
        return self.A, self.B

    @property
    def AB(self) -> Tensor:  # noqa: N802 (TransformerLens's names)
        """M itself, (..., ldim, rdim): the one thing here that forms the big matrix."""
        return self.A @ self.B

    @property
    def BA(self) -> Tensor:  # noqa: N802
        """B @ A, (..., mdim, mdim); only defined when M is square (ldim == rdim)."""
        if self.ldim != self.rdim:
            raise InputError(f"BA needs a square matrix (ldim == rdim), got shape "
                             f"{tuple(self.shape)}")
        return self.B @ self.A

    @property
    def T(self) -> FactoredMatrix:  # noqa: N802
        """M^T = B^T A^T."""
        return FactoredMatrix(self.B.mT, self.A.mT)

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"

    # --- products -----------------------------------------------------------------------------

    def __matmul__(self, other: Tensor | FactoredMatrix) -> FactoredMatrix | Tensor:
        """M @ other: a FactoredMatrix, or a (..., ldim) vector when other is a vector."""
        if isinstance(other, FactoredMatrix):
            check_chain(self.shape, other.shape)
            check_same_kind(self.A, other.A, "the two FactoredMatrices")
            return (self @ other.A) @ other.B
        if not isinstance(other, Tensor):
            return NotImplemented
        if other.dim() == 0:
            raise InputError("a 0-dim tensor is a scalar: multiply with *, not @")
        check_same_kind(self.A, other, "the FactoredMatrix and the tensor")
        if other.dim() == 1:
            check_chain(self.shape, other.shape + (1,))
            return (self.A @ (self.B @ other.unsqueeze(-1))).squeeze(-1)  # (..., ldim)
        check_chain(self.shape, other.shape)
        if self.rdim > self.mdim:
            return FactoredMatrix(self.A, self.B @ other)
        return FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other: Tensor | FactoredMatrix) -> FactoredMatrix | Tensor:
        """other @ M: a FactoredMatrix, or a (..., rdim) vector when other is a vector."""
        if isinstance(other, FactoredMatrix):
            return other @ self
        if not isinstance(other, Tensor):
            return NotImplemented
        if other.dim() == 0:
            raise InputError("a 0-dim tensor is a scalar: multiply with *, not @")
        check_same_kind(other, self.A, "the tensor and the FactoredMatrix")
        if other.dim() == 1:
            check_chain((1,) + tuple(other.shape), self.shape)
            return ((other.unsqueeze(-2) @ self.A) @ self.B).squeeze(-2)  # (..., rdim)
        check_chain(other.shape, self.shape)
        if self.ldim > self.mdim:
            return FactoredMatrix(other @ self.A, self.B)
        return FactoredMatrix(other, self.AB)

    def __mul__(self, scalar: Scalar) -> FactoredMatrix:
        """c M = (c A) B: a scalar scales one factor."""
        if isinstance(scalar, Tensor):
            if scalar.numel() != 1:
                raise InputError(f"* takes a scalar, got a tensor of shape {tuple(scalar.shape)};"
                                 f" for a matrix product use @")
        elif not isinstance(scalar, numbers.Number):
            return NotImplemented
        return FactoredMatrix(self.A * scalar, self.B)

    def __rmul__(self, scalar: Scalar) -> FactoredMatrix:
        return self.__mul__(scalar)

    # --- spectra, from the factors alone (see the module's docstring) -------------------------

    @cached_property
    def _svd(self) -> tuple[Tensor, Tensor, Tensor]:
        A, B = float_for_linalg(self.A), float_for_linalg(self.B)
        Ua, Sa, Vha = torch.linalg.svd(A, full_matrices=False)  # (.., l, ka) (.., ka) (.., ka, m)
        Ub, Sb, Vhb = torch.linalg.svd(B, full_matrices=False)  # (.., m, kb) (.., kb) (.., kb, r)
        middle = Sa.unsqueeze(-1) * (Vha @ Ub) * Sb.unsqueeze(-2)  # (..., ka, kb)
        Um, S, Vhm = torch.linalg.svd(middle, full_matrices=False)  # k = min(ka, kb)
        return Ua @ Um, S, Vhb.mT @ Vhm.mT  # (..., l, k), (..., k), (..., r, k)

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """(U, S, V) with M = U @ diag(S) @ V^T; computed once and kept."""
        return self._svd

    @property
    def U(self) -> Tensor:  # noqa: N802
        return self._svd[0]

    @property
    def S(self) -> Tensor:  # noqa: N802
        return self._svd[1]

    @property
    def V(self) -> Tensor:  # noqa: N802
        return self._svd[2]

    @property
    def Vh(self) -> Tensor:  # noqa: N802
        """V again, not V^T: TransformerLens's old name for it, kept (with its warning) so code
        written for TransformerLens gets the same matrix."""
        warnings.warn("FactoredMatrix.Vh is V (M = U diag(S) V^T), not V^T; use .V",
                      DeprecationWarning, stacklevel=2)
        return self._svd[2]

    @property
    def eigenvalues(self) -> Tensor:
        """(..., mdim) complex: the eigenvalues of BA, which are AB's (plus zeros)."""
        return torch.linalg.eig(float_for_linalg(self.BA)).eigenvalues

    def norm(self) -> Tensor:
        """(...,) the Frobenius norm, from the factors' QR (see the module's docstring)."""
        Ra = torch.linalg.qr(float_for_linalg(self.A)).R  # (..., ka, mdim), ka = min(l, m)
        Rb = torch.linalg.qr(float_for_linalg(self.B).mT).R  # (..., kb, mdim), kb = min(r, m)
        return torch.linalg.matrix_norm(Ra @ Rb.mT)

    def make_even(self) -> FactoredMatrix:
        """The same M as (U sqrt(S)) @ (sqrt(S) V^T): both factors carry half the spectrum."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root.unsqueeze(-2), root.unsqueeze(-1) * self.V.mT)

    def collapse_l(self) -> Tensor:
        """diag(S) V^T, (..., k, rdim): M with its left orthonormal factor U dropped."""
        return self.S.unsqueeze(-1) * self.V.mT

    def collapse_r(self) -> Tensor:
        """U diag(S), (..., ldim, k): M with its right orthonormal factor V^T dropped."""
        return self.U * self.S.unsqueeze(-2)

    def get_corner(self, k: int = 3) -> Tensor:
        """M's first k entries along every dim (a peek that forms only a k x k corner)."""
        corner = self.A[..., :k, :] @ self.B[..., :, :k]
        return corner[tuple(slice(k) for _ in range(corner.dim()))]

    def unsqueeze(self, k: int) -> FactoredMatrix:
        """A new leading dim of size 1 at k (a position among the leading dims)."""
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    # --- indexing -----------------------------------------------------------------------------

    def __getitem__(self, index: Any) -> FactoredMatrix:
        """Index M's dims without forming M: leading dims index both factors; a row index indexes
        A's rows, a column index B's columns. An integer row or column index keeps its dim
        (size 1), so the result is still a matrix; None adds a dim anywhere, ... fills."""
        items = fill_ellipsis(index if isinstance(index, tuple) else (index,), self.ndim)
        n_leading = self.ndim - 2
        factor_items: list[Any] = []
        new_matrix_dims: list[int] = []  # 0: before the rows, 1: between, 2: after the columns
        used = 0
        for item in items:
            if item is None and used >= n_leading:
                new_matrix_dims.append(used - n_leading)
            else:
                factor_items.append(item)
            used += dims_used(item)
        if used > self.ndim:
            raise InputError(f"index {index!r:.80} has {used} dims, too many for a "
                             f"FactoredMatrix of shape {tuple(self.shape)}")
        result = self._index_factors(tuple(factor_items), used - n_leading)
        for where in new_matrix_dims:
            result = result._new_matrix_dim(where)
        return result

    def _index_factors(self, items: tuple, matrix_dims_indexed: int) -> FactoredMatrix:
        try:
            return self._indexed(items, matrix_dims_indexed)
        except (IndexError, TypeError) as error:  # torch's words for a bad index, named here
            reason = str(error).splitlines()[0][:120]
            raise FactoredIndexError(f"index {items!r:.80} does not index a FactoredMatrix of "
                                     f"shape {tuple(self.shape)}: {reason}") from None

    def _indexed(self, items: tuple, matrix_dims_indexed: int) -> FactoredMatrix:
        if matrix_dims_indexed <= 0:
            return FactoredMatrix(self.A[items], self.B[items])
        if matrix_dims_indexed == 1:
            leading, rows = items[:-1], keep_dim(items[-1], self.ldim)
            return FactoredMatrix(self.A[leading + (rows,)], self.B[leading])
        leading = items[:-2]
        rows, columns = keep_dim(items[-2], self.ldim), keep_dim(items[-1], self.rdim)
        return FactoredMatrix(self.A[leading + (rows,)], self.B[leading + (slice(None), columns)])

    def _new_matrix_dim(self, where: int) -> FactoredMatrix:
        """A size-1 dim inserted before the rows (0), between rows and columns (1) or after the
        columns (2), keeping the factored form."""
        if where == 0:  # (..., 1, l, r): a new leading dim
            return FactoredMatrix(self.A.unsqueeze(-3), self.B.unsqueeze(-3))
        if where == 1:  # (..., l, 1, r): the rows become a leading dim over 1 x r matrices
            return FactoredMatrix(self.A.unsqueeze(-2), self.B.unsqueeze(-3))
        # (..., l, r, 1): rows and columns become leading (l) and rows (r) over one column:
        # entry [.., i, j, 0] = sum_m A[i, m] B[m, j] = sum_m B^T[j, m] A[i, m].
        return FactoredMatrix(self.B.mT.unsqueeze(-3), self.A.unsqueeze(-1))


def check_chain(left: tuple[int, ...] | torch.Size, right: tuple[int, ...] | torch.Size) -> None:
    """InputError unless a (..., n, k) matrix can multiply a (..., k, m) one (leading dims
    that broadcast)."""
    if left[-1] != right[-2]:
        raise InputError(f"shapes {tuple(left)} and {tuple(right)} do not chain: "
                         f"{left[-1]} != {right[-2]}")
    try:
        torch.broadcast_shapes(tuple(left[:-2]), tuple(right[:-2]))
    except RuntimeError:
        raise InputError(f"shapes {tuple(left)} and {tuple(right)} do not chain: their leading "
                         f"dims do not broadcast") from None


def check_same_kind(left: Tensor, right: Tensor, what: str) -> None:
    """InputError unless two tensors to be multiplied share a dtype and a device (torch's
    matmul would refuse them midway, or an SVD would run in the wrong precision)."""
    if left.dtype != right.dtype or left.device != right.device:
        raise InputError(f"{what} must share a dtype and a device, got {left.dtype} on "
                         f"{left.device} and {right.dtype} on {right.device}")


def float_for_linalg(x: Tensor) -> Tensor:
    """float16 and bfloat16 as float32: torch.linalg's SVD and eig have no 16-bit kernels."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def dims_used(item: Any) -> int:
    """How many dims of the indexed tensor one index item consumes, as torch counts them: None
    and ... none, a boolean mask one per dim of its own, anything else one."""
    if item is None or item is Ellipsis:
        return 0
    if isinstance(item, (list, tuple)) or (hasattr(item, "__array__")
                                           and not isinstance(item, Tensor)):
        item = torch.as_tensor(item)
    if isinstance(item, Tensor) and item.dtype in (torch.bool, torch.uint8):
        return item.dim()
    return 1


def fill_ellipsis(items: tuple, ndim: int) -> tuple:
    """`items` with its one ... replaced by as many full slices as the dims it stands for."""
    where = [i for i, item in enumerate(items) if item is Ellipsis]
    if len(where) > 1:
        raise InputError("an index can hold one ... at most")
    if not where:
        return items
    missing = max(ndim - sum(dims_used(item) for item in items), 0)
    return items[:where[0]] + (slice(None),) * missing + items[where[0] + 1:]


def keep_dim(item: Any, size: int) -> Any:
    """An integer index of a row or column (of a dim of `size`) as the one-long slice that
    keeps its dim (-1 becomes slice(-1, None), since slice(-1, 0) is empty); any other index as
    it is. A Python bool is an int here (True: row 1), as in TransformerLens. An int past the
    end is refused: as a slice it would give an empty matrix, not an error."""
    if isinstance(item, Tensor) and item.dim() == 0 and not item.is_floating_point() \
            and not item.is_complex() and item.dtype != torch.bool:
        item = int(item)
    if isinstance(item, numbers.Integral):
        if not -size <= int(item) < size:
            raise IndexError(f"index {int(item)} is out of range for a dim of size {size}")
        return slice(int(item), int(item) + 1 or None)
    return item
