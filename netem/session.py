"""A shaping session: many interfaces of one namespace shaped by one owner, fast.

`apply` and `change` read the kernel back before they act (a helper process, a dump, two nft
runs) and work on one interface at a time: right for a command line, slow for a testbed that
changes the links of 32 workers at once (992 links). A `Session` is for a caller that alone
shapes a set of interfaces (a lab's switch ports): it remembers the plan it installed on each,
so a change

- is computed against what it installed, not read back;
- redoes only the steps whose values differ, in place when the tree stays the same (no moment
  unshaped, no queue flushed), rebuilding only an interface whose sources changed;
- sends the fallback's loss changes of every interface to the kernel in one nft transaction
  (one process, all or nothing), and the rest in parallel threads (each interface is a few
  short helper processes that mostly wait).

A fresh interface is not cleared first, and with `offloads=False` the plan's offload step is
left out (the caller turned them off already, as `netem.lab.Lab` does).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from netem.backend import apply, carry_out, nft_script, usable
from netem.plan import NFT_TABLE, Direction, NftLoss, Offloads, Plan, Rules, build_plan

PARALLEL = 8  # interfaces shaped at once


class Session:
    """Shapes interfaces of `netns` with `backend` in `direction`; see the module's docstring.
    Thread-safe: changes from several threads go one at a time."""

    def __init__(self, netns: str | None, *,
                 backend: Literal["auto", "netem", "fallback"] = "auto",
                 direction: Direction = "egress", offloads: bool = True,
                 parallel: int = PARALLEL) -> None:
        self.netns, self.direction, self.offloads, self.parallel = (
            netns, direction, offloads, parallel)
        self.backend = usable(backend)
        self._plans: dict[str, Plan] = {}  # what each interface carries, as installed
        self._lock = threading.Lock()

    def plan(self, iface: str, rules: Rules) -> Plan:
        """The plan for `rules` on `iface` (pure: raises `UnsupportedByKernel` where the
        backend cannot shape them, before anything is touched)."""
        return build_plan(iface, rules, direction=self.direction, backend=self.backend)

    def installed(self, iface: str) -> Plan | None:
        return self._plans.get(iface)

    def shape(self, rules: Mapping[str, Rules]) -> float:
        """Give each interface its rules (installing on a fresh one, changing what differs on
        the others); returns the seconds it took."""
        with self._lock:
            begun = time.perf_counter()
            plans = {iface: self.plan(iface, given) for iface, given in rules.items()}
            self._shape(plans)
            return time.perf_counter() - begun

    def forget(self) -> None:
        """Drop what was installed from memory (the interfaces went with their namespace)."""
        with self._lock:
            self._plans.clear()

    # -- how

    def _shape(self, plans: dict[str, Plan]) -> None:
        # The fallback keeps every interface's loss in one nft table of the namespace and
        # deletes the table with its last chain. Interfaces that may delete it must not overlap
        # those that add to it: first the fresh ones and those whose nft chain alone changes,
        # in one transaction that knows whether the table stays; then the others (they add to
        # the table or touch only their own chain and tree) in parallel, then those losing
        # their last loss rule in parallel (each sees the others' chains until they are gone),
        # then those rebuilt while lossy: all but one in parallel while the last one's chain
        # keeps the table, then that one.
        fallback = self.backend == "fallback"
        fresh = {iface: plan for iface, plan in plans.items() if iface not in self._plans}
        self._in_parallel(sorted(fresh), lambda iface: self._install(fresh[iface]))
        rebuilt = {iface for iface, plan in plans.items() if iface not in fresh
                   and plan.layout != self._plans[iface].layout}
        rebuilt_lossy = {iface for iface in rebuilt if fallback and _lossy(self._plans[iface])}
        nft_only = {iface: plan for iface, plan in plans.items()
                    if iface in fresh or (iface not in rebuilt and self._nft_only(plan))}
        others = set(plans) - set(nft_only) - rebuilt_lossy
        losing = {iface for iface in others
                  if fallback and _lossy(self._plans[iface]) and not _lossy(plans[iface])}
        lossy_after = any(_lossy(plan) for plan in plans.values()) or any(
            _lossy(plan) for iface, plan in self._plans.items() if iface not in plans)
        self._nft_change(nft_only, keep_table=lossy_after)
        self._in_parallel(sorted(others - losing), lambda iface: self._change(plans[iface]))
        self._in_parallel(sorted(losing), lambda iface: self._change(plans[iface]))
        *together, last = sorted(rebuilt_lossy) or [None]
        self._in_parallel(together, lambda iface: self._change(plans[iface]))
        if last is not None:
            self._change(plans[last])

    def _in_parallel(self, ifaces: list[str], do: Callable[[str], None]) -> None:
        if len(ifaces) == 1:
            do(ifaces[0])
        elif ifaces:
            with ThreadPoolExecutor(min(len(ifaces), self.parallel)) as pool:
                for future in [pool.submit(do, iface) for iface in ifaces]:
                    future.result()

    def _install(self, plan: Plan) -> None:
        """A fresh interface's tree: no clear (nothing to clear), no nft step (`_nft_change`
        does every interface's at once), no offload step unless asked."""
        skipped = (NftLoss,) if self.offloads else (NftLoss, Offloads)
        steps = tuple(step for step in plan.steps if not isinstance(step, skipped))
        carry_out(dataclasses.replace(plan, steps=steps), self.netns, change=False)
        # Installed but for its loss chain, which the nft transaction adds next.
        self._plans[plan.iface] = dataclasses.replace(
            plan, steps=tuple(s for s in plan.steps if not isinstance(s, NftLoss)))

    def _nft_only(self, plan: Plan) -> bool:
        """Whether, in place, at most the interface's nft loss chain differs."""
        installed = self._plans[plan.iface]
        return plan.layout == installed.layout and _tree(plan) == _tree(installed)

    def _nft_change(self, plans: Mapping[str, Plan], *, keep_table: bool) -> None:
        """Give these interfaces their plans' loss chains (or none) in one nft transaction.
        Without `keep_table` (no interface will have loss) the table goes with the chains."""
        statements, removed = [], []
        for iface, plan in plans.items():
            installed = [s for s in self._plans[iface].steps if isinstance(s, NftLoss)]
            steps = [step for step in plan.steps if isinstance(step, NftLoss)]
            statements += [line for step in steps for line in step.statements()]
            if installed and not steps:
                removed.append(installed[0])
        if keep_table:
            statements += [f"delete chain {s.family} {NFT_TABLE} {s.chain}" for s in removed]
        elif removed:
            statements += sorted({f"delete table {s.family} {NFT_TABLE}" for s in removed})
        if statements:
            nft_script(statements, self.netns)
        self._plans.update(plans)

    def _change(self, plan: Plan) -> None:
        """In place when the layout is the same, redoing only the steps that differ (the nft
        loss step always: an in-place change without one removes the chain); else rebuilt. A
        netem leaf redone gets its whole profile, its seed too: netem draws its random numbers
        from the seed's start again."""
        installed = self._plans.pop(plan.iface)  # unknown until this succeeds
        if plan.layout == installed.layout:
            steps = tuple(step for step in plan.steps
                          if step not in installed.steps or isinstance(step, NftLoss))
            carry_out(dataclasses.replace(plan, steps=steps), self.netns, change=True)
        else:
            apply(plan.iface, plan.as_rules(), netns=self.netns, direction=self.direction,
                  backend=self.backend)
        self._plans[plan.iface] = plan


def _tree(plan: Plan) -> list:
    return [step for step in plan.steps if not isinstance(step, NftLoss)]


def _lossy(plan: Plan) -> bool:
    """Whether the plan has an nft loss chain (the fallback's loss)."""
    return any(isinstance(step, NftLoss) for step in plan.steps)
