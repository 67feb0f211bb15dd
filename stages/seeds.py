"""Seeds of iteration-local randomness: one named stream per use, equal across resumes and retries.

Every random draw of an iteration (token sampling, mini-batch shuffles, torch's RNG during the
update) is seeded from ``(trainer.seed, iteration, salt)`` alone, never from what ran before in the
process. That is what makes a resumed or retried stage reproduce the original bit for bit.
"""

from __future__ import annotations

from enum import IntEnum


class Salt(IntEnum):
    """The stream of an iteration a seed is for (the values are part of every stored run: never renumber)."""

    ROLLOUT = 0          # token sampling of the iteration's (first) generation batch
    UPDATE_SHUFFLE = 1   # order of rows into the actor's mini-batches
    VALIDATION = 2       # sampling of the held-out prompts (seeded by the validation step)
    REMAX_GREEDY = 3     # ReMax's greedy baseline rollout
    CRITIC_SHUFFLE = 4   # order of rows into the critic's mini-batches
    UPDATE_RNG = 5       # torch's global RNG during the actor update (dropout, ...)

    @staticmethod
    def validation_chunk(chunk: int) -> int:
        """The salt of validation's generation call ``chunk`` (``data.val_batch_size`` prompts each):
        chunk 0 is seeded as a validation in one call was (``VALIDATION``), later chunks get ``1000 + k``."""
        return int(Salt.VALIDATION) if chunk == 0 else 1000 + int(chunk)

    @staticmethod
    def dynamic(gen_batch: int) -> int:
        """The salt of dynamic sampling's generation batch ``gen_batch`` (0 is the iteration's own batch,
        seeded like any rollout; later batches get ``100 + k``)."""
        return int(Salt.ROLLOUT) if gen_batch == 0 else 100 + int(gen_batch)


def iteration_seed(seed: int, iteration: int, salt: int = Salt.ROLLOUT) -> int:
    """Seed for one stream of iteration-local randomness.

    Args:
        seed: ``trainer.seed``.
        iteration: the iteration (or validation step).
        salt: which stream (:class:`Salt`, or :meth:`Salt.dynamic`).

    Returns:
        An int in ``[0, 2**31 - 1)``.
    """
    return (int(seed) * 1_000_003 + int(iteration) * 7919 + int(salt)) % (2**31 - 1)
