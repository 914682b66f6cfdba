"""glassgpt's FactoredMatrix against (a) the dense product formed directly and (b) TransformerLens
4.3's own FactoredMatrix on the same random float64 factors: every method and operator, batched
leading dims, every `@` combination, indexing, and the refusal of shapes that do not chain.

Where both libraries run the same arithmetic (products, indexing, the factors' choice of inner
size) the factors must be equal exactly; spectra agree within 1e-10.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformer_lens")

from transformer_lens import FactoredMatrix as LensFactoredMatrix  # noqa: E402

from glassgpt.errors import InputError  # noqa: E402
from glassgpt.interp.hooked_gpt.factored import FactoredMatrix  # noqa: E402

TOL = 1e-10


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def both(A: torch.Tensor, B: torch.Tensor) -> tuple[FactoredMatrix, LensFactoredMatrix]:
    return FactoredMatrix(A, B), LensFactoredMatrix(A, B)


def same_factors(ours: object, theirs: object) -> None:
    """ours is a glassgpt FactoredMatrix with exactly TransformerLens's factors and sizes."""
    assert isinstance(ours, FactoredMatrix)
    assert ours.shape == theirs.shape
    assert (ours.ldim, ours.mdim, ours.rdim) == (theirs.ldim, theirs.mdim, theirs.rdim)
    assert torch.equal(ours.A, theirs.A) and torch.equal(ours.B, theirs.B)


def close(x: torch.Tensor, y: torch.Tensor, tol: float = TOL) -> None:
    assert x.shape == y.shape, (x.shape, y.shape)
    torch.testing.assert_close(x, y, atol=tol, rtol=tol)


# --- construction and plain attributes ----------------------------------------------------------

def test_attributes_match_the_dense_product_and_transformer_lens() -> None:
    A, B = rand(3, 1, 5, 4), rand(2, 4, 6, seed=1)  # leading dims (3, 1) and (2,) broadcast
    ours, theirs = both(A, B)
    same_factors(ours, theirs)
    assert ours.shape == torch.Size([3, 2, 5, 6]) and ours.ndim == 4
    assert ours.has_leading_dims and not FactoredMatrix(rand(5, 4), rand(4, 6)).has_leading_dims
    assert repr(ours) == repr(theirs)
    assert ours.pair[0] is ours.A and ours.pair[1] is ours.B
    close(ours.AB, A @ B)
    close(ours.T.AB, (A @ B).mT)
    same_factors(ours.T, theirs.T)
    square = FactoredMatrix(rand(2, 5, 3), rand(2, 3, 5, seed=1))
    close(square.BA, square.B @ square.A)
    assert square.BA.shape == (2, 3, 3)


# --- products -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mdim, rdim", [(3, 6), (6, 3), (4, 4)])  # rdim >, < and = mdim
def test_matmul_with_a_matrix_on_the_right(mdim: int, rdim: int) -> None:
    ours, theirs = both(rand(2, 5, mdim), rand(2, mdim, rdim, seed=1))
    X = rand(3, 1, rdim, 7, seed=2)  # broadcasts against the leading (2,)
    same_factors(ours @ X, theirs @ X)
    close((ours @ X).AB, ours.AB @ X)
    assert (ours @ X).mdim == min(mdim, rdim)  # the smaller inner size is kept


@pytest.mark.parametrize("ldim, mdim", [(6, 3), (3, 6), (4, 4)])  # ldim >, < and = mdim
def test_matmul_with_a_matrix_on_the_left(ldim: int, mdim: int) -> None:
    ours, theirs = both(rand(2, ldim, mdim), rand(2, mdim, 5, seed=1))
    X = rand(3, 1, 7, ldim, seed=2)
    same_factors(X @ ours, X @ theirs)
    close((X @ ours).AB, X @ ours.AB)
    assert (X @ ours).mdim == min(mdim, ldim)


def test_matmul_with_a_parameter_on_the_left() -> None:
    ours, theirs = both(rand(5, 3), rand(3, 6, seed=1))
    W = torch.nn.Parameter(rand(4, 5, seed=2))
    same_factors(W @ ours, W @ theirs)


def test_matmul_with_vectors_gives_vectors() -> None:
    ours, theirs = both(rand(2, 5, 3), rand(2, 3, 6, seed=1))
    right, left = rand(6, seed=2), rand(5, seed=3)
    close(ours @ right, ours.AB @ right)
    close(left @ ours, left @ ours.AB)
    assert torch.equal(ours @ right, theirs @ right)
    assert torch.equal(left @ ours, left @ theirs)
    assert (ours @ right).shape == (2, 5) and (left @ ours).shape == (2, 6)


@pytest.mark.parametrize("inner", [2, 8])  # the second matrix's inner size below and above
def test_matmul_of_two_factored_matrices(inner: int) -> None:
    ours, theirs = both(rand(3, 5, 4), rand(3, 4, 6, seed=1))
    ours2, theirs2 = both(rand(6, inner, seed=2), rand(inner, 7, seed=3))
    same_factors(ours @ ours2, theirs @ theirs2)
    close((ours @ ours2).AB, ours.AB @ ours2.AB)
    assert (ours2.T @ ours.T).shape == (3, 7, 5)
    close((ours2.T @ ours.T).AB, (ours.AB @ ours2.AB).mT)


def test_arena_full_ov_circuit_stays_factored() -> None:
    # ARENA 1.2 (OV circuits): FactoredMatrix(model.W_E, model.W_V[1, 4]) @ model.W_O[1, 4] @ W_U
    vocab, C, L, H, d = 40, 12, 2, 5, 3
    W_E, W_U = rand(vocab, C), rand(C, vocab, seed=1)
    W_V, W_O = rand(L, H, C, d, seed=2), rand(L, H, d, C, seed=3)
    ours = FactoredMatrix(W_E, W_V[1, 4]) @ W_O[1, 4] @ W_U
    theirs = LensFactoredMatrix(W_E, W_V[1, 4]) @ W_O[1, 4] @ W_U
    same_factors(ours, theirs)
    assert ours.shape == (vocab, vocab) and ours.mdim == d
    close(ours.AB, W_E @ W_V[1, 4] @ W_O[1, 4] @ W_U)
    every_ov = FactoredMatrix(W_V, W_O)  # (L, H, C, C), as model.OV
    close(every_ov[1, 4].AB, W_V[1, 4] @ W_O[1, 4])
    close(every_ov[1].AB, W_V[1] @ W_O[1])


@pytest.mark.parametrize("scalar", [3, -0.5, torch.tensor(2.5, dtype=torch.float64),
                                    torch.tensor([2.0], dtype=torch.float64)])
def test_scalar_multiplication_on_either_side(scalar: object) -> None:
    ours, theirs = both(rand(2, 5, 3), rand(2, 3, 6, seed=1))
    for product, reference in ((ours * scalar, theirs * scalar),
                               (scalar * ours, scalar * theirs)):
        same_factors(product, reference)
        close(product.AB, ours.AB * scalar)


# --- spectra ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape_a, shape_b", [
    ((2, 3, 7, 4), (2, 3, 4, 6)),  # mdim the smallest: k = mdim
    ((5, 8), (8, 6)),  # mdim the largest: k = min(ldim, rdim)
    ((4, 6), (6, 9)),
])
def test_svd_against_the_dense_matrix_and_transformer_lens(shape_a: tuple, shape_b: tuple) -> None:
    ours, theirs = both(rand(*shape_a), rand(*shape_b, seed=1))
    U, S, V = ours.svd()
    k = min(ours.ldim, ours.mdim, ours.rdim)
    assert U.shape == ours.shape[:-2] + (ours.ldim, k) and S.shape == ours.shape[:-2] + (k,)
    assert V.shape == ours.shape[:-2] + (ours.rdim, k)
    close(U @ torch.diag_embed(S) @ V.mT, ours.AB)
    eye = torch.eye(k, dtype=torch.float64)
    close(U.mT @ U, eye.expand_as(U.mT @ U))
    close(V.mT @ V, eye.expand_as(V.mT @ V))
    close(S, torch.linalg.svdvals(ours.AB)[..., :k])
    lens_U, lens_S, lens_V = theirs.svd()
    close(S, lens_S)
    # singular vectors are fixed up to each column's sign; both run the same decomposition
    close(U, lens_U)
    close(V, lens_V)
    assert ours.svd() is ours.svd()  # computed once
    assert ours.U is U and ours.S is S and ours.V is V


def test_vh_is_v_with_transformer_lens_warning() -> None:
    ours = FactoredMatrix(rand(5, 3), rand(3, 6, seed=1))
    with pytest.warns(DeprecationWarning):
        assert ours.Vh is ours.V


def test_norm_is_the_frobenius_norm() -> None:
    ours, theirs = both(rand(2, 3, 7, 4), rand(2, 3, 4, 6, seed=1))
    close(ours.norm(), torch.linalg.matrix_norm(ours.AB))
    close(ours.norm(), theirs.norm())
    assert ours.norm().shape == (2, 3)
    wide = FactoredMatrix(rand(5, 9), rand(9, 6, seed=2))  # mdim above ldim and rdim
    close(wide.norm(), torch.linalg.matrix_norm(wide.AB))
    for seed in range(4):  # AB ~ 1e-16: the norm must not be the square root of rounding
        A = rand(3, 5, seed=seed)
        B = torch.linalg.svd(A).Vh[3:].mT @ rand(2, 6, seed=seed + 1)  # in A's null space
        near_zero = FactoredMatrix(A, B)
        close(near_zero.norm(), torch.linalg.matrix_norm(A @ B), 1e-14)
        close(near_zero.norm(), LensFactoredMatrix(A, B).norm(), 1e-14)


def test_eigenvalues_are_those_of_the_dense_matrix() -> None:
    ours, theirs = both(rand(2, 7, 3), rand(2, 3, 7, seed=1))
    values = ours.eigenvalues
    assert values.shape == (2, 3) and values.is_complex()
    close(values, theirs.eigenvalues)
    dense = torch.linalg.eigvals(ours.AB)  # (2, 7): the same 3 values and 4 zeros
    for batch in range(2):
        distance = (values[batch, :, None] - dense[batch, None, :]).abs()
        assert distance.min(dim=1).values.max() < 1e-8
        nearest = distance.argmin(dim=1)
        assert len(set(nearest.tolist())) == 3  # three different dense values matched
        rest = [i for i in range(7) if i not in nearest.tolist()]
        assert dense[batch, rest].abs().max() < 1e-8
    close(values.sum(-1).real, torch.diagonal(ours.AB, dim1=-2, dim2=-1).sum(-1))


def test_sixteen_bit_factors_get_float32_spectra_like_transformer_lens() -> None:
    A, B = rand(6, 3).to(torch.bfloat16), rand(3, 6, seed=1).to(torch.bfloat16)
    ours, theirs = both(A, B)
    assert ours.S.dtype == theirs.S.dtype == torch.float32
    assert ours.norm().dtype == theirs.norm().dtype == torch.float32
    close(ours.norm(), theirs.norm(), 1e-5)
    close(ours.eigenvalues, theirs.eigenvalues, 1e-5)


def test_make_even_collapse_corner_and_unsqueeze() -> None:
    ours, theirs = both(rand(2, 7, 3), rand(2, 3, 6, seed=1))
    even = ours.make_even()
    close(even.AB, ours.AB)
    close(torch.linalg.svdvals(even.A), ours.S.sqrt())  # each half carries sqrt(S)
    close(torch.linalg.svdvals(even.B), ours.S.sqrt())
    close(even.A, theirs.make_even().A)
    close(even.B, theirs.make_even().B)
    close(ours.collapse_l(), ours.U.mT @ ours.AB)  # diag(S) V^T = U^T M
    close(ours.collapse_r(), ours.AB @ ours.V)  # U diag(S) = M V
    close(ours.collapse_l(), theirs.collapse_l())
    close(ours.collapse_r(), theirs.collapse_r())
    for k in (2, 3, 9):
        close(ours.get_corner(k), ours.AB[:k, :k, :k])
        assert torch.equal(ours.get_corner(k), theirs.get_corner(k))
    assert torch.equal(ours.get_corner(), ours.get_corner(3))
    same_factors(ours.unsqueeze(0), theirs.unsqueeze(0))
    assert ours.unsqueeze(1).shape == (2, 1, 7, 6)


# --- indexing -----------------------------------------------------------------------------------

# (index, the same entries of the dense (2, 3, 5, 6) product): an integer row or column index
# keeps its dim, as TransformerLens's does
INDEXES = [
    ((1,), (1,)),
    ((1, 2), (1, 2)),
    ((-1, -1), (-1, -1)),
    ((slice(0, 2), [0, 2]), (slice(0, 2), [0, 2])),
    ((torch.tensor([True, False]),), (torch.tensor([True, False]),)),
    ((torch.tensor([[True, False, True], [False, True, True]]),),
     (torch.tensor([[True, False, True], [False, True, True]]),)),  # a mask over two dims
    ((Ellipsis, 1, 2), (Ellipsis, slice(1, 2), slice(2, 3))),
    ((1, 2, -1), (1, 2, slice(-1, None))),
    ((0, 1, slice(1, 3), -1), (0, 1, slice(1, 3), slice(-1, None))),
    ((0, 1, torch.tensor(3)), (0, 1, slice(3, 4))),
    ((0, 0, [0, 4]), (0, 0, [0, 4])),
    ((torch.tensor([[True, False, True], [False, True, True]]), 1),
     (torch.tensor([[True, False, True], [False, True, True]]), slice(1, 2))),
    ((torch.tensor([[True, False, True], [False, True, True]]), Ellipsis, 2),
     (torch.tensor([[True, False, True], [False, True, True]]), Ellipsis, slice(2, 3))),
    ((None,), (None,)),
    ((Ellipsis, None), (Ellipsis, None)),
    ((0, 0, None), (0, 0, None)),
    ((0, 0, slice(None), None), (0, 0, slice(None), None)),
    ((1, Ellipsis, None, slice(None), None), (1, Ellipsis, None, slice(None), None)),
    ((None, 1, Ellipsis), (None, 1, Ellipsis)),
]


@pytest.mark.parametrize("index, dense_index", INDEXES, ids=[str(i) for i, _ in INDEXES])
def test_indexing_never_forms_the_product(index: tuple, dense_index: tuple) -> None:
    ours, theirs = both(rand(2, 3, 5, 4), rand(2, 3, 4, 6, seed=1))
    picked = ours[index]
    same_factors(picked, theirs[index])
    close(picked.AB, ours.AB[dense_index])


def test_indexing_a_single_integer_without_a_tuple() -> None:
    ours = FactoredMatrix(rand(4, 5, 3), rand(4, 3, 6, seed=1))
    close(ours[2].AB, ours.AB[2])
    close(ours[-1].AB, ours.AB[-1])
    theirs = LensFactoredMatrix(ours.A, ours.B)
    same_factors(ours[0, True], theirs[0, True])  # a bool row index is row 1 in both


# --- refusals -----------------------------------------------------------------------------------

def refused(call, *shapes: tuple) -> None:
    """call() raises an InputError whose line names every one of `shapes`."""
    with pytest.raises(InputError) as caught:
        call()
    for shape in shapes:
        assert str(shape) in str(caught.value), (shape, str(caught.value))


def test_mismatched_shapes_are_refused_naming_both() -> None:
    refused(lambda: FactoredMatrix(rand(5, 3), rand(4, 6)), (5, 3), (4, 6))
    refused(lambda: FactoredMatrix(rand(2, 5, 3), rand(3, 3, 6)), (2, 5, 3), (3, 3, 6))
    fm = FactoredMatrix(rand(2, 5, 3), rand(2, 3, 6, seed=1))  # (2, 5, 6)
    refused(lambda: fm @ rand(5, 7), (2, 5, 6), (5, 7))
    refused(lambda: rand(7, 6) @ fm, (7, 6), (2, 5, 6))
    refused(lambda: fm @ rand(5), (2, 5, 6), (5, 1))
    refused(lambda: rand(6) @ fm, (1, 6), (2, 5, 6))
    other = FactoredMatrix(rand(5, 2), rand(2, 4))  # (5, 4): 6 != 5
    refused(lambda: fm @ other, (2, 5, 6), (5, 4))
    refused(lambda: fm.BA, (2, 5, 6))
    refused(lambda: fm.eigenvalues, (2, 5, 6))
    refused(lambda: fm * rand(2, 2), (2, 2))
    refused(lambda: fm[0, 0, 0, 0], (2, 5, 6))


def test_other_misuse_is_refused() -> None:
    fm = FactoredMatrix(rand(5, 3), rand(3, 6, seed=1))
    for call in (lambda: FactoredMatrix(rand(5), rand(5, 2)),
                 lambda: FactoredMatrix([[1.0]], rand(1, 2)),
                 lambda: fm @ torch.tensor(2.0, dtype=torch.float64),
                 lambda: fm[..., ...]):
        with pytest.raises(InputError):
            call()
    with pytest.raises(TypeError):
        fm @ "W_U"  # noqa: B018 (the operator is what is tested)
    with pytest.raises(TypeError):
        fm * "2"  # noqa: B018
