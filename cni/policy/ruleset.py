"""The nftables state policy enforcement wants, as plain data, and the ``nft -f`` scripts that make the kernel hold
it: the whole table at once (:func:`full_script`), or the difference from what it holds (:func:`diff_script`).

A :class:`Ruleset` is what :mod:`cni.policy.compile` produces for one node: named sets and verdict maps with their
elements, chains with their rules (base chains with their hook line), and named counters. Element sets are frozen
and shared between rulesets where unchanged, so comparing two rulesets costs little where little changed.

The full script deletes and recreates the table in one transaction (the kernel swaps old for new atomically:
no packet sees a half-made table). The difference is one transaction too, ordered so that every reference is valid
at each step: new counters, sets and (empty) chains first; then elements added; chains whose rules changed
flushed and refilled (chain replacement); map entries changed; elements deleted; then the chains, sets and
counters nothing refers to any more deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TABLE = "nodeplug-policy"
CHUNK = 2000  # elements per "add element" line


@dataclass(frozen=True)
class SetSpec:
    """``type`` as nft writes it (``ipv4_addr``, ``ipv4_addr . inet_proto . inet_service``); a map's value type in
    ``value`` (``verdict``)."""

    type: str
    interval: bool = False
    value: str = ""

    def declare(self, table: str, name: str) -> str:
        kind = "map" if self.value else "set"
        typ = f"{self.type} : {self.value}" if self.value else self.type
        flags = " flags interval;" if self.interval else ""
        return f"add {kind} inet {table} {name} {{ type {typ};{flags} }}\n"


@dataclass(frozen=True)
class Chain:
    rules: tuple[str, ...] = ()
    hook: str = ""  # a base chain's "type filter hook forward priority -1; policy accept;"


@dataclass
class Ruleset:
    sets: dict[str, SetSpec] = field(default_factory=dict)
    # set name -> its elements; a map's elements are "key : verdict" strings keyed by key
    elements: dict[str, frozenset[str]] = field(default_factory=dict)
    maps: dict[str, Mapping[str, str]] = field(default_factory=dict)
    chains: dict[str, Chain] = field(default_factory=dict)
    counters: frozenset[str] = frozenset()

    def size(self) -> tuple[int, int, int]:
        """(chains, sets and maps, elements and map entries)."""
        elements = sum(len(e) for e in self.elements.values()) + sum(len(m) for m in self.maps.values())
        return len(self.chains), len(self.sets), elements


def _chunks(items: Iterable[str]) -> Iterable[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) >= CHUNK:
            yield batch
            batch = []
    if batch:
        yield batch


def _elements(verb: str, table: str, name: str, items: Iterable[str]) -> list[str]:
    return [f"{verb} element inet {table} {name} {{ {', '.join(b)} }}\n" for b in _chunks(sorted(items))]


def _map_items(entries: Mapping[str, str], keys: Iterable[str]) -> list[str]:
    return [f"{k} : {entries[k]}" for k in keys]


def _chain_rules(table: str, name: str, chain: Chain) -> list[str]:
    return [f"add rule inet {table} {name} {r}\n" for r in chain.rules]


def _declare_chain(table: str, name: str, chain: Chain) -> str:
    return f"add chain inet {table} {name}" + (f" {{ {chain.hook} }}\n" if chain.hook else "\n")


def full_script(want: Ruleset, table: str = TABLE) -> str:
    """The table made anew as ``want`` says, in one transaction (whatever was there before)."""
    out = [f"table inet {table} {{}}\n", f"delete table inet {table}\n", f"add table inet {table}\n"]
    out += [f"add counter inet {table} {c}\n" for c in sorted(want.counters)]
    for name, spec in sorted(want.sets.items()):
        out.append(spec.declare(table, name))
    for name, chain in sorted(want.chains.items()):
        out.append(_declare_chain(table, name, chain))
    for name, items in sorted(want.elements.items()):
        out += _elements("add", table, name, items)
    for name, chain in sorted(want.chains.items()):
        out += _chain_rules(table, name, chain)
    for name, entries in sorted(want.maps.items()):
        out += _elements("add", table, name, _map_items(entries, entries))
    return "".join(out)


def diff_script(have: Ruleset, want: Ruleset, table: str = TABLE) -> str:
    """The changes that turn ``have`` (what the kernel holds) into ``want``, in one transaction; "" when equal."""
    out: list[str] = []
    late: list[str] = []  # deletions, after nothing refers to them
    new_counters = want.counters - have.counters
    out += [f"add counter inet {table} {c}\n" for c in sorted(new_counters)]
    for name, spec in sorted(want.sets.items()):
        if name not in have.sets:
            out.append(spec.declare(table, name))
        elif have.sets[name] != spec:  # names carry their content's hash: never seen; the caller replaces the table
            raise ValueError(f"set {name}: its type changed; needs a full replacement")
    new_chains = {n for n, c in want.chains.items() if n not in have.chains}
    for name in sorted(new_chains):
        out.append(_declare_chain(table, name, want.chains[name]))
    for name in sorted(n for n, c in want.chains.items() if n in have.chains and have.chains[n].hook != c.hook):
        raise ValueError(f"chain {name}: its hook changed; needs a full replacement")
    # elements added (sets), and the rules of new and changed chains
    dels: list[str] = []
    for name, items in sorted(want.elements.items()):
        before = have.elements.get(name, frozenset())
        if items is before:
            continue
        out += _elements("add", table, name, items - before)
        dels += _elements("delete", table, name, before - items)
    for name, chain in sorted(want.chains.items()):
        old = have.chains.get(name)
        if old is None:
            out += _chain_rules(table, name, chain)
        elif old.rules != chain.rules:
            out.append(f"flush chain inet {table} {name}\n")
            out += _chain_rules(table, name, chain)
    for name, entries in sorted(want.maps.items()):
        was: Mapping[str, str] = have.maps.get(name, {})
        if entries is was:
            continue
        gone = [k for k in was if entries.get(k) != was[k]]
        added = [k for k in entries if was.get(k) != entries[k]]
        out += _elements("delete", table, name, gone)
        out += _elements("add", table, name, _map_items(entries, added))
    out += dels
    for name in sorted(set(have.chains) - set(want.chains)):
        late.append(f"flush chain inet {table} {name}\n")
    for name in sorted(set(have.chains) - set(want.chains)):
        late.append(f"delete chain inet {table} {name}\n")
    for name in sorted(set(have.sets) - set(want.sets)):
        late.append(f"delete {'map' if have.sets[name].value else 'set'} inet {table} {name}\n")
    late += [f"delete counter inet {table} {c}\n" for c in sorted(have.counters - want.counters)]
    return "".join(out + late)
