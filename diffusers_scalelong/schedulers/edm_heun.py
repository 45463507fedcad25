"""EDM's second-order (Heun) sampler as a diffusers scheduler.

The sampler of Karras et al. 2022 (Algorithm 2), used unchanged by EDM2: a Karras sigma schedule
``t_i = (smax^(1/rho) + i/(N-1) (smin^(1/rho) - smax^(1/rho)))^rho``, ``t_N = 0``; at each step an optional
churn ``t̂_i = t_i (1 + gamma_i)``, ``x̂_i = x_i + sqrt(t̂_i^2 - t_i^2) S_noise eps``; an Euler step
``d_i = (x̂_i - D(x̂_i; t̂_i)) / t̂_i``, ``x_{i+1} = x̂_i + (t_{i+1} - t̂_i) d_i``; and, on every step but the
last, the Heun correction ``x_{i+1} = x̂_i + (t_{i+1} - t̂_i) (d_i + d'_i) / 2`` with
``d'_i = (x_{i+1} - D(x_{i+1}; t_{i+1})) / t_{i+1}``. N steps cost 2N - 1 network evaluations.

Preconditioning and the ``timesteps`` convention are those of diffusers' ``EDMEulerScheduler``: the model is the raw
network F, ``timesteps`` are ``c_noise = ln(sigma) / 4``, ``scale_model_input`` multiplies by
``c_in = 1 / sqrt(sigma^2 + sigma_data^2)`` and ``D = c_skip x + c_out F`` (the c-functions of
:mod:`.edm_preconditioning`, shared with ``EDMPreconditioner``). One model therefore works with
``EDMEulerScheduler``, ``EDMDPMSolverMultistepScheduler`` and this scheduler, and ``from_config`` converts between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.schedulers.scheduling_utils import SchedulerMixin
from diffusers.utils import BaseOutput
from diffusers.utils.torch_utils import randn_tensor

from ..validation import check_count, check_number, check_sigma
from .edm_preconditioning import edm_c_in, edm_c_noise, edm_c_out, edm_c_skip

#: Most steps of a schedule: 100x the 1000 of diffusers' ``num_train_timesteps``. Every step is a network evaluation,
#: and steps are found by their float32 c_noise value, which must differ from the neighbours' (checked as well).
MAX_STEPS = 100_000


@dataclass
class EDMHeunSchedulerOutput(BaseOutput):
    """Output of `EDMHeunScheduler.step`.

    Args:
        prev_sample: the sample to feed to the model at the next entry of `timesteps` (after the last entry: the
            final sample).
        pred_original_sample: the denoised estimate ``D(x; sigma)`` at the current entry.
    """

    prev_sample: torch.Tensor
    pred_original_sample: torch.Tensor | None = None


class EDMHeunScheduler(SchedulerMixin, ConfigMixin):
    """Heun (2nd order) EDM sampler with optional stochastic churn.

    The two stages of a Heun step are two calls of `step`, as in diffusers' `HeunDiscreteScheduler`:
    `timesteps` holds the c_noise value of every network evaluation, ``[t̂_0, t_1, t̂_1, t_2, ..., t_{N-1}, t̂_{N-1}]``
    (without churn ``t̂_i = t_i``, so interior steps appear twice), 2N - 1 entries for N steps.

    Differences from `EDMEulerScheduler` to keep in mind:

    - `init_noise_sigma` is ``sigma_max`` (EDM starts from ``noise * sigma_max``), where `EDMEulerScheduler` uses
      ``sqrt(sigma_max^2 + 1)``. With churn at the first step, the churn noise is folded into the initial noise:
      ``init_noise_sigma = sqrt(t_0^2 + S_noise^2 (t̂_0^2 - t_0^2))``, which gives ``x̂_0`` exactly EDM's distribution.
    - churn is applied before the network is evaluated at ``t̂_i`` (EDM's order): `step` adds the churn of step
      i + 1 to the sample it returns after the correction of step i, drawing from `generator`.

    Args:
        sigma_min: smallest sigma of the schedule (EDM: 0.002).
        sigma_max: largest sigma of the schedule and the initial noise level (EDM: 80).
        sigma_data: standard deviation of the data, used by the preconditioning (EDM: 0.5). The three sigmas must lie
            in ``[1e-18, 1e18]``, where their squares stay normal float32 numbers (``SIGMA_RANGE``).
        sigma_schedule: ``"karras"`` (EDM, with `rho`) or ``"exponential"`` (log-linear), as in `EDMEulerScheduler`.
        num_train_timesteps: kept for configuration compatibility with the other EDM schedulers.
        prediction_type: ``"epsilon"`` (``D = c_skip x + c_out F``, the EDM/EDM2 network) or ``"v_prediction"``
            (``c_out`` negated), with the meaning these names have in `EDMEulerScheduler`.
        rho: exponent of the Karras schedule (EDM: 7).
        final_sigmas_type: only ``"zero"`` (``t_N = 0``) is supported; present for `from_config` compatibility.
        S_churn: total churn; ``gamma_i = min(S_churn / N, sqrt(2) - 1)`` where ``S_min <= t_i <= S_max``, else 0.
            0 (default) gives the deterministic sampler.
        S_min: smallest sigma that receives churn.
        S_max: largest sigma that receives churn; ``None`` means no upper bound.
        S_noise: scale of the churn noise (EDM: slightly above 1 compensates detail loss).

    Examples:
        >>> import torch
        >>> from diffusers_scalelong import EDMHeunScheduler
        >>> scheduler = EDMHeunScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=0.5)
        >>> scheduler.set_timesteps(num_inference_steps=3)
        >>> len(scheduler.timesteps)  # 2N - 1 network evaluations
        5
        >>> sample = torch.randn(1, 1, 4, 4, generator=torch.manual_seed(0)) * scheduler.init_noise_sigma
        >>> for t in scheduler.timesteps:
        ...     model_input = scheduler.scale_model_input(sample, t)  # c_in(sigma) x
        ...     model_output = torch.zeros_like(sample)  # F(c_in x, c_noise) of a network; 0 here
        ...     sample = scheduler.step(model_output, t, sample).prev_sample
        >>> float(scheduler.sigmas[-1])  # the last step lands on sigma = 0
        0.0
    """

    _compatibles = ["EDMEulerScheduler", "EDMDPMSolverMultistepScheduler"]
    order = 2

    @register_to_config
    def __init__(
        self,
        sigma_min: float = 0.002,
        sigma_max: float = 80.0,
        sigma_data: float = 0.5,
        sigma_schedule: Literal["karras", "exponential"] = "karras",
        num_train_timesteps: int = 1000,
        prediction_type: Literal["epsilon", "v_prediction"] = "epsilon",
        rho: float = 7.0,
        final_sigmas_type: Literal["zero"] = "zero",
        S_churn: float = 0.0,
        S_min: float = 0.0,
        S_max: float | None = None,
        S_noise: float = 1.0,
    ) -> None:
        if sigma_schedule not in ("karras", "exponential"):
            raise ValueError(f"sigma_schedule must be 'karras' or 'exponential', got {sigma_schedule!r}")
        if prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {prediction_type!r}")
        if final_sigmas_type != "zero":
            raise ValueError(f"final_sigmas_type must be 'zero' for the EDM Heun sampler, got {final_sigmas_type!r}")
        check_sigma("sigma_min", sigma_min)
        check_sigma("sigma_max", sigma_max)
        if sigma_min >= sigma_max:
            raise ValueError(f"need sigma_min < sigma_max, got sigma_min={sigma_min}, sigma_max={sigma_max}")
        check_sigma("sigma_data", sigma_data)
        check_number("rho", rho, 0.0, low_inclusive=False)
        check_count("num_train_timesteps", num_train_timesteps, 1, MAX_STEPS)
        check_number("S_churn", S_churn, 0.0)
        check_number("S_noise", S_noise, 0.0)
        check_number("S_min", S_min, 0.0)
        if S_max is not None and S_max != float("inf"):  # None or inf: churn at every noise level above S_min
            check_number("S_max", S_max, S_min)
        self.num_inference_steps: int | None = None
        self._step_index: int | None = None
        self._begin_index: int | None = None
        self._clear_heun_state()
        self.set_timesteps(num_train_timesteps)

    # ------------------------------------------------------------------ schedule
    def step_sigmas(self, num_inference_steps: int) -> torch.Tensor:
        """The N + 1 step boundaries ``t_0 > ... > t_{N-1} > t_N = 0`` (float64)."""
        n = num_inference_steps
        smin, smax = self.config.sigma_min, self.config.sigma_max
        ramp = torch.linspace(0, 1, n, dtype=torch.float64) if n > 1 else torch.zeros(1, dtype=torch.float64)
        if self.config.sigma_schedule == "karras":
            inv_rho = 1.0 / self.config.rho
            sigmas = (smax**inv_rho + ramp * (smin**inv_rho - smax**inv_rho)) ** self.config.rho
        else:
            sigmas = torch.exp(math.log(smax) + ramp * (math.log(smin) - math.log(smax)))
        return torch.cat([sigmas, sigmas.new_zeros(1)])

    def churn_gammas(self, step_sigmas: torch.Tensor) -> torch.Tensor:
        """``gamma_i = min(S_churn / N, sqrt(2) - 1)`` for ``S_min <= t_i <= S_max``, else 0 (N values)."""
        t = step_sigmas[:-1]
        s_max = math.inf if self.config.S_max is None else self.config.S_max
        gamma = min(self.config.S_churn / len(t), math.sqrt(2) - 1)
        in_range = (t >= self.config.S_min) & (t <= s_max)
        return torch.where(in_range, torch.full_like(t, gamma), torch.zeros_like(t))

    def set_timesteps(self, num_inference_steps: int, device: str | torch.device | None = None) -> None:
        """Build the evaluation schedule for `num_inference_steps` Heun steps (2N - 1 network evaluations).

        `sigmas` holds the sigma of every evaluation followed by the final ``t_N = 0``; `timesteps` holds the
        matching c_noise values ``ln(sigma) / 4`` (float32, on `device`).
        """
        num_inference_steps = check_count("num_inference_steps", num_inference_steps, 1, MAX_STEPS)
        try:
            t = self.step_sigmas(num_inference_steps)
        except OverflowError:  # sigma ** (1 / rho) beyond float64
            t = torch.full((num_inference_steps + 1,), math.inf, dtype=torch.float64)
        self._check_schedule(t)
        self.num_inference_steps = num_inference_steps
        t_hat = t[:-1] * (1 + self.churn_gammas(t))
        evaluations = [t_hat[0]]
        for i in range(1, num_inference_steps):
            evaluations += [t[i], t_hat[i]]
        eval_sigmas = torch.stack(evaluations)
        self._initial_sigma = math.sqrt(t[0] ** 2 + self.config.S_noise**2 * (t_hat[0] ** 2 - t[0] ** 2))
        self.sigmas = torch.cat([eval_sigmas, t[-1:]]).to(torch.float32)
        self.timesteps = self.precondition_noise(eval_sigmas).to(dtype=torch.float32, device=device)
        self._step_index = None
        self._begin_index = None
        self._clear_heun_state()

    def _check_schedule(self, t: torch.Tensor) -> None:
        """The step boundaries must be finite and strictly decreasing in float32, and so must their c_noise values
        (`step` finds its place by value)."""
        levels = t[:-1]
        if not torch.isfinite(levels).all() or not (levels > 0).all():
            raise ValueError(
                f"rho={self.config.rho} with sigma_min={self.config.sigma_min}, sigma_max={self.config.sigma_max} "
                "gives a schedule that leaves float64's range; choose rho nearer EDM's 7"
            )
        c_noise = self.precondition_noise(levels).to(torch.float32)
        if len(levels) > 1 and not (c_noise[1:] < c_noise[:-1]).all():
            raise ValueError(
                f"num_inference_steps={len(levels)} is too many for sigma_min={self.config.sigma_min}, "
                f"sigma_max={self.config.sigma_max}: neighbouring steps get the same float32 timestep"
            )

    @property
    def init_noise_sigma(self) -> float:
        """Standard deviation of the initial noise: ``sigma_max`` (see the class docstring for churn)."""
        return self._initial_sigma

    # ------------------------------------------------------------------ EDM preconditioning
    def precondition_inputs(self, sample: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
        """``c_in x`` with ``c_in = 1 / sqrt(sigma^2 + sigma_data^2)``."""
        return sample * edm_c_in(sigma, self.config.sigma_data)

    def precondition_noise(self, sigma: float | torch.Tensor) -> torch.Tensor:
        """``c_noise = ln(sigma) / 4`` (the values stored in `timesteps`)."""
        return edm_c_noise(sigma if isinstance(sigma, torch.Tensor) else torch.tensor([sigma]))

    def precondition_outputs(
        self, sample: torch.Tensor, model_output: torch.Tensor, sigma: float | torch.Tensor
    ) -> torch.Tensor:
        """Denoiser ``D = c_skip x + c_out F``, ``c_skip = sd^2/(s^2+sd^2)``, ``c_out = ±s sd/sqrt(s^2+sd^2)``."""
        c_out = edm_c_out(sigma, self.config.sigma_data)
        if self.config.prediction_type == "v_prediction":
            c_out = -c_out
        return edm_c_skip(sigma, self.config.sigma_data) * sample + c_out * model_output

    def scale_model_input(self, sample: torch.Tensor, timestep: float | torch.Tensor) -> torch.Tensor:
        """Network input ``c_in(sigma) x`` for the current entry of `timesteps`."""
        if self._step_index is None:
            self._init_step_index(timestep)
        return self.precondition_inputs(sample, self.sigmas[self._step_index])

    # ------------------------------------------------------------------ step bookkeeping
    @property
    def step_index(self) -> int | None:
        """Index of the current entry of `timesteps` (advances by one per `step` call)."""
        return self._step_index

    @property
    def begin_index(self) -> int | None:
        """First entry of `timesteps` to run, when set by a pipeline (e.g. image-to-image)."""
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start sampling at entry `begin_index` of `timesteps`."""
        self._begin_index = begin_index

    @property
    def state_in_first_order(self) -> bool:
        """True when the next `step` call is an Euler step (False: the Heun correction of the previous one)."""
        return self._euler_derivative is None

    def _clear_heun_state(self) -> None:
        self._euler_derivative: torch.Tensor | None = None
        self._euler_start: torch.Tensor | None = None
        self._euler_sigma: torch.Tensor | None = None

    def index_for_timestep(self, timestep: float | torch.Tensor, schedule_timesteps: torch.Tensor | None = None) -> int:
        """Index of the entry of `schedule_timesteps` (default `timesteps`) equal to `timestep`.

        Without churn interior values appear twice (the correction landing on t_i, then the Euler step from t_i);
        a loop that starts at such a value starts with the Euler step, so the last match is returned.
        """
        schedule_timesteps = self.timesteps if schedule_timesteps is None else schedule_timesteps
        matches = (schedule_timesteps == torch.as_tensor(timestep, device=schedule_timesteps.device)).nonzero()
        if len(matches) == 0:
            raise ValueError(f"timestep {float(timestep)} is not in this scheduler's `timesteps`")
        return int(matches[-1].item())

    def _init_step_index(self, timestep: float | torch.Tensor) -> None:
        self._step_index = self.index_for_timestep(timestep) if self._begin_index is None else self._begin_index

    def _check_current_timestep(self, timestep: float | torch.Tensor, k: int) -> None:
        """``timestep`` must be entry ``k`` of `timesteps` (the entries are stepped in order, each once)."""
        if k >= len(self.timesteps):
            raise ValueError(
                f"all {len(self.timesteps)} entries of `timesteps` have been stepped; call set_timesteps() to sample "
                "again"
            )
        expected = self.timesteps[k]
        if isinstance(timestep, torch.Tensor) and timestep.data_ptr() == expected.data_ptr():
            return  # the entry itself, as a loop over `timesteps` passes it: no device synchronisation
        if float(timestep) != float(expected):
            raise ValueError(
                f"timestep {float(timestep)} is not the scheduler's next entry timesteps[{k}] = {float(expected)}: "
                "step() must follow `timesteps` in order, one call per entry (set_timesteps() restarts)"
            )

    # ------------------------------------------------------------------ sampling
    def step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        generator: torch.Generator | list[torch.Generator] | None = None,
        return_dict: bool = True,
    ) -> EDMHeunSchedulerOutput | tuple[torch.Tensor, torch.Tensor]:
        """Advance by one entry of `timesteps`: an Euler step, or the Heun correction of the previous Euler step.

        Args:
            model_output: raw network output F at ``(scale_model_input(sample, timestep), timestep)``.
            timestep: the current entry of `timesteps` (a float c_noise value, not an integer index).
            sample: the current sample (``x̂_i`` for an Euler step, the Euler prediction for a correction).
            generator: random generator(s) for the churn noise (only drawn when churn is active).
            return_dict: return an `EDMHeunSchedulerOutput` (True) or a tuple ``(prev_sample, pred_original_sample)``.
        """
        if isinstance(timestep, int) or (isinstance(timestep, torch.Tensor) and not timestep.is_floating_point()):
            raise ValueError(
                "EDMHeunScheduler.step() takes an entry of `scheduler.timesteps` (a float c_noise value), "
                f"not an integer index; got {timestep!r}"
            )
        if not isinstance(model_output, torch.Tensor) or not isinstance(sample, torch.Tensor):
            raise ValueError("model_output and sample must be tensors")
        if model_output.shape != sample.shape:
            raise ValueError(
                f"model_output has shape {list(model_output.shape)}, but sample has shape {list(sample.shape)}: "
                "pass the network's output for this sample"
            )
        if self._step_index is None:
            self._init_step_index(timestep)
        k = self._step_index
        self._check_current_timestep(timestep, k)
        sample = sample.to(torch.float32)
        sigma, sigma_next = self.sigmas[k], self.sigmas[k + 1]
        denoised = self.precondition_outputs(sample, model_output.to(torch.float32), sigma)
        derivative = (sample - denoised) / sigma

        if self.state_in_first_order:
            prev_sample = sample + (sigma_next - sigma) * derivative
            if k + 1 < len(self.timesteps):  # not the last step: its Heun correction follows
                self._euler_derivative, self._euler_start, self._euler_sigma = derivative, sample, sigma
        else:
            mean_derivative = 0.5 * (self._euler_derivative + derivative)
            prev_sample = self._euler_start + (sigma - self._euler_sigma) * mean_derivative
            self._clear_heun_state()
            if sigma_next > sigma:  # churn of the next step: raise the noise level from t_{i+1} to t̂_{i+1}
                noise = randn_tensor(prev_sample.shape, generator=generator, device=prev_sample.device)
                prev_sample = prev_sample + (sigma_next**2 - sigma**2) ** 0.5 * self.config.S_noise * noise

        self._step_index = k + 1
        prev_sample = prev_sample.to(model_output.dtype)
        if not return_dict:
            return prev_sample, denoised
        return EDMHeunSchedulerOutput(prev_sample=prev_sample, pred_original_sample=denoised)

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """``x + sigma n`` with ``sigma = exp(4 c_noise)`` for each c_noise value in `timesteps` (one per sample)."""
        if noise.shape != original_samples.shape:
            raise ValueError(
                f"noise has shape {list(noise.shape)}, original_samples {list(original_samples.shape)}: they must match"
            )
        if timesteps.numel() not in (1, original_samples.shape[0]):
            raise ValueError(
                f"timesteps has {timesteps.numel()} values for {original_samples.shape[0]} samples: give 1 or one per "
                "sample"
            )
        sigma = torch.exp(4.0 * timesteps.to(device=original_samples.device, dtype=torch.float32))
        sigma = sigma.reshape(-1, *([1] * (original_samples.ndim - 1))).to(original_samples.dtype)
        return original_samples + noise * sigma

    def __len__(self) -> int:
        return self.config.num_train_timesteps
