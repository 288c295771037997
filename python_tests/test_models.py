"""Variational posteriors of kivi_fast.nn: the MLP generator (with its optional second noise), MMNN
(the paper's Alg. 2) and the factorized Gaussian baseline."""

import pytest
import torch
from torch.distributions import Normal, kl_divergence

from kivi_fast.nn import (MMNN, FactorizedGaussian, MatrixMultiplicationLayer, MLPGenerator, NoiseInjection,
                          gaussian_kl_to_standard_normal, stochastic_net_2d)


def n_params(module):
    return sum(p.numel() for p in module.parameters())


# ---- MLP generator ------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes", [(20, 30, 700), (100, 800, 357, 357), (5, 20, 51)])
def test_mlp_generator_shapes_and_structure(sizes):
    g = MLPGenerator(sizes)
    z = g.sample(7)
    assert z.shape == (7, sizes[-1]) and g.dim == sizes[-1] and g.noise_dim == sizes[0]
    linears = [m for m in g.net if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == list(zip(sizes[:-1], sizes[1:]))
    # ReLU between hidden layers only: the output layer is linear
    assert sum(isinstance(m, torch.nn.ReLU) for m in g.net) == len(sizes) - 2
    assert not isinstance(g.net[-1], torch.nn.ReLU)


def test_mlp_generator_is_reparameterized_and_random():
    g = MLPGenerator((4, 8, 3))
    z = g.sample(5)
    z.pow(2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in g.parameters())
    assert not torch.equal(g.sample(5), g.sample(5))


def test_mlp_generator_rejects_bad_sizes():
    with pytest.raises(ValueError):
        MLPGenerator((3,))
    with pytest.raises(ValueError):
        MLPGenerator((3, 0, 2))
    with pytest.raises(ValueError, match="init must be one of"):
        MLPGenerator((3, 4, 2), init="xavier")
    with pytest.raises(ValueError, match="activation must be one of"):
        MLPGenerator((3, 4, 2), activation="gelu")
    for bad in (0, 2):
        with pytest.raises(ValueError, match="noise_at must name a hidden layer"):
            MLPGenerator((3, 4, 2), noise_at=bad)


def test_generator_with_a_second_noise_is_the_papers_2d_network():
    """stochastic_net_2d: FC + ReLU -> FC (linear) -> + xi (trainable std) -> FC + ReLU -> FC, with
    torch.nn.Linear's initialization; the noise draws come from the generator passed in."""
    net = stochastic_net_2d()
    kinds = [type(m).__name__ for m in net.net]
    assert kinds == ["Linear", "ReLU", "Linear", "NoiseInjection", "Linear", "ReLU", "Linear"]
    assert [m.out_features for m in net.net if isinstance(m, torch.nn.Linear)] == [20, 20, 20, 2]
    noise = net.net[3]
    assert isinstance(noise, NoiseInjection) and torch.equal(noise.log_std, torch.zeros(20))
    z = net.sample(300, torch.Generator().manual_seed(1))
    assert z.shape == (300, 2)
    torch.testing.assert_close(net.sample(300, torch.Generator().manual_seed(1)), z, rtol=0, atol=0)
    # by hand: the same two draws, in the same order
    g = torch.Generator().manual_seed(1)
    eps = torch.randn(300, 2, generator=g)
    h = net.net[2](torch.relu(net.net[0](eps)))
    h = h + torch.randn(h.shape, generator=g) * noise.log_std.exp()
    torch.testing.assert_close(net.net[6](torch.relu(net.net[4](h))), z, rtol=0, atol=0)
    z.sum().backward()
    assert noise.log_std.grad is not None and noise.log_std.grad.abs().sum() > 0
    tanh = MLPGenerator((2, 5, 5, 1), activation="tanh", init="torch")
    assert sum(isinstance(m, torch.nn.Tanh) for m in tanh.net) == 2 and tanh.output_layer is tanh.net[-1]


def test_mlp_generator_initializations():
    torch.manual_seed(0)
    glorot = MLPGenerator((100, 800, 350), init="glorot")
    for layer in (m for m in glorot.net if isinstance(m, torch.nn.Linear)):
        bound = (6 / (layer.in_features + layer.out_features)) ** 0.5  # Glorot-uniform's limit
        assert torch.count_nonzero(layer.bias) == 0
        assert layer.weight.abs().max() <= bound and layer.weight.abs().max() > 0.99 * bound
        assert layer.weight.var().item() == pytest.approx(bound**2 / 3, rel=0.02)
    torch.manual_seed(0)
    default = MLPGenerator((100, 800, 350), init="torch")
    first = default.net[0]
    assert torch.count_nonzero(first.bias) > 0 and first.weight.abs().max() <= 1 / 100**0.5  # nn.Linear's own
    # the point of Glorot here: Yacht's first-layer samples start ~3 times wider (closer to the N(0, I) prior)
    torch.manual_seed(0)
    wide, narrow = MLPGenerator((100, 800, 350, 350)), MLPGenerator((100, 800, 350, 350), init="torch")
    assert wide.sample(500).std(0).mean() > 2 * narrow.sample(500).std(0).mean()


# ---- MMNN ---------------------------------------------------------------------------------------

def test_mm_layer_computes_left_then_right_multiplication():
    layer = MatrixMultiplicationLayer((3, 4), (5, 6))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
    x = torch.randn(2, 3, 4)
    a_l, a_r = layer.left / 3 ** 0.5, layer.right / 4 ** 0.5  # stored at unit scale, 1/sqrt(fan-in) applied
    expected = torch.stack([(a_l @ xi + layer.left_bias) @ a_r + layer.right_bias for xi in x])
    torch.testing.assert_close(layer(x), expected)
    assert layer.left.shape == (5, 3) and layer.left_bias.shape == (5, 4)
    assert layer.right.shape == (4, 6) and layer.right_bias.shape == (5, 6)



@pytest.mark.parametrize("m0,n0,m,n", [(30, 30, 400, 785), (3, 4, 5, 6), (1, 1, 1, 1), (30, 30, 10, 1201)])
def test_mm_layer_parameter_count_is_the_papers_formula(m0, n0, m, n):
    """Sec. 4: an M0 x N0 -> M x N layer has M M0 + M N0 + N0 N + M N parameters."""
    layer = MatrixMultiplicationLayer((m0, n0), (m, n))
    assert n_params(layer) == m * m0 + m * n0 + n0 * n + m * n
    assert MatrixMultiplicationLayer.n_parameters((m0, n0), (m, n)) == n_params(layer)
    # and far fewer than a dense layer between the flattened matrices, M0 N0 M N
    if m0 * n0 * m * n > 1:
        assert n_params(layer) < m0 * n0 * m * n + m * n


def test_mmnn_shapes_and_count_for_the_papers_mnist_layer():
    """App. "Classification", L = 400: noise 30 x 30, two 500 x 500 ReLU layers, a linear 400 x 785 output."""
    shapes = [(30, 30), (500, 500), (500, 500), (400, 785)]
    net = MMNN(shapes)
    assert n_params(net) == sum(MatrixMultiplicationLayer.n_parameters(a, b) for a, b in zip(shapes[:-1], shapes[1:]))
    small = MMNN([(3, 2), (4, 5), (6, 7)])
    mats = small.sample_matrices(8)
    assert mats.shape == (8, 6, 7)
    assert small.sample(8).shape == (8, 42) and small.dim == 42


def test_mmnn_relu_between_layers_linear_output():
    net = MMNN([(3, 2), (4, 5), (6, 7), (2, 3)])
    seen = []
    for layer in net.layers:
        layer.register_forward_hook(lambda mod, inp, out: seen.append(inp[0]))
    out = net.sample_matrices(50)
    # the inputs of layers 2 and 3 went through a ReLU, the noise did not; the output is not clipped
    assert (seen[0] < 0).any() and (seen[1] >= 0).all() and (seen[2] >= 0).all()
    assert (out < 0).any()


def test_mmnn_flattening_is_row_major():
    net = MMNN([(2, 2), (3, 4)])
    torch.manual_seed(0)
    m = net.sample_matrices(2)
    torch.manual_seed(0)
    torch.testing.assert_close(net.sample(2), m.reshape(2, 12))


# ---- factorized Gaussian -------------------------------------------------------------------------

@pytest.mark.parametrize("std_param", ["softplus", "exp"])
def test_factorized_density_entropy_and_kl_match_torch_distributions(std_param):
    q = FactorizedGaussian(20, std=0.7, mean_init_std=1.0, std_param=std_param)
    with torch.no_grad():
        q.rho.add_(torch.randn(20))
    normal = Normal(q.mean, q.std)
    torch.testing.assert_close(q.kl_to_standard_normal(), kl_divergence(normal, Normal(0.0, 1.0)).sum())
    torch.testing.assert_close(q.entropy(), normal.entropy().sum())
    w = torch.randn(7, 20)
    torch.testing.assert_close(q.log_prob(w), normal.log_prob(w).sum(-1))
    torch.testing.assert_close(q.log_std, q.std.log())
    torch.testing.assert_close(gaussian_kl_to_standard_normal(q.mean, q.log_std), q.kl_to_standard_normal())


def test_factorized_initialization():
    q = FactorizedGaussian(4, mean=1.5, std=0.25, std_param="exp")
    assert torch.equal(q.mean, torch.full((4,), 1.5)) and torch.allclose(q.std, torch.full((4,), 0.25))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    FactorizedGaussian(4)  # no random means: the global generator is not touched
    assert torch.equal(torch.get_rng_state(), state)
    noisy = FactorizedGaussian(5000, std=1e-2, mean_init_std=0.1)
    assert abs(float(noisy.mean.detach().std()) - 0.1) < 0.01
    assert torch.allclose(noisy.std.detach(), torch.full((5000,), 1e-2))
    with pytest.raises(ValueError):
        FactorizedGaussian(2, std_param="square")
    with pytest.raises(ValueError):
        FactorizedGaussian(2, std=0.0)


def test_factorized_sample_moments_and_gradients():
    q = FactorizedGaussian(3, std=0.5)
    with torch.no_grad():
        q.mean.copy_(torch.tensor([1.0, -2.0, 0.0]))
    z = q.sample(20000)
    torch.testing.assert_close(z.mean(0), q.mean.detach(), atol=0.03, rtol=0)
    torch.testing.assert_close(z.std(0), q.std.detach(), atol=0.02, rtol=0)
    z.sum().backward()
    assert q.mean.grad is not None and q.rho.grad is not None
