"""Who computes what: a request's branches and token rows over the ranks of a parallel group.

With true CFG and an even number of ranks, the cond and uncond branches run on two halves of the ranks at once
(CFG parallelism: one exchange of predictions per step); each half, or all ranks without CFG, splits the image's
tokens (Ulysses sequence parallelism: each rank keeps a contiguous share of the rows and, for attention, a share of
the heads).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError

BRANCHES = ("cond", "uncond")


@dataclass(frozen=True)
class ParallelPlan:
    """`world` ranks in `cfg_groups` groups (2: one per CFG branch, else 1) of `sp` ranks each. Rank r is in group
    `r // sp` at position `r % sp`."""

    world: int
    cfg_groups: int = 1

    @property
    def sp(self) -> int:
        return self.world // self.cfg_groups

    def group_of(self, rank: int) -> int:
        return rank // self.sp

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp

    def sp_ranks(self, group: int) -> list[int]:
        return list(range(group * self.sp, (group + 1) * self.sp))

    def cfg_pair(self, rank: int) -> list[int]:
        """The ranks at `rank`'s position in every CFG group (they exchange predictions)."""
        return [group * self.sp + self.sp_rank(rank) for group in range(self.cfg_groups)]

    def branches(self, rank: int, names) -> tuple[str, ...]:
        """Which of a request's branches `rank` computes: its group's one under CFG parallelism, else all."""
        names = tuple(names)
        if self.cfg_groups == 1:
            return names
        return (BRANCHES[self.group_of(rank)],)

    def key(self, rank: int) -> tuple:
        """What a rank's graph keys carry (GraphKey.parallel)."""
        return (("world", self.world), ("rank", rank), ("cfg_groups", self.cfg_groups), ("sp", self.sp),
                ("sp_rank", self.sp_rank(rank)))


def plan_for(world: int, cfg: bool) -> ParallelPlan:
    """CFG parallelism whenever the request has both branches and the ranks pair up; sequence parallelism over the
    rest."""
    if cfg and world % 2 == 0:
        return ParallelPlan(world, 2)
    return ParallelPlan(world, 1)


def check_heads(world: int, heads: int, name: str = "gpus") -> None:
    """Ulysses splits the attention heads evenly over a sequence-parallel group, and a CFG group is half the
    ranks, so the head count must divide evenly by the whole count."""
    if heads % world:
        fits = [n for n in range(1, heads + 1) if heads % n == 0 and n <= 16]
        raise InputError(name, world, f"a count that divides the transformer's {heads} attention heads evenly "
                                       f"({', '.join(map(str, fits))})")


def row_counts(total: int, parts: int) -> list[int]:
    """Rows per rank for `total` rows over `parts` ranks, contiguous and in rank order; the first `total % parts`
    ranks take one more (as `torch.tensor_split`)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def row_slice(total: int, parts: int, index: int) -> slice:
    counts = row_counts(total, parts)
    start = sum(counts[:index])
    return slice(start, start + counts[index])
