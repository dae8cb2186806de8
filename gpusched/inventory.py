"""Which cards this run may use: real ones through NVML, or simulated ones.

Real cards are read through NVML (nvidia-ml-py, imported lazily: no driver means
zero cards) and restricted to an outer ``CUDA_VISIBLE_DEVICES``; ``--gpus`` then
picks among them. Simulated cards (``--simulate-gpus``) exist only as ids handed
to children in ``CUDA_VISIBLE_DEVICES``; nothing touches a driver.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpusched.requirements import RequirementError, parse_memory


class InventoryError(ValueError):
    """A card selection or simulation spec that cannot be satisfied or parsed."""


@dataclass(frozen=True)
class Card:
    """One card: ``id`` as it goes into ``CUDA_VISIBLE_DEVICES``; memory in bytes if known."""

    id: str
    memory: int | None = None


def parse_simulate_spec(spec: str) -> list[Card]:
    """Cards from ``"N"`` or ``"N:80GB,80GB,40GB"`` (one size for all, or one per card)."""
    count_text, _, memories_text = spec.partition(":")
    try:
        count = int(count_text.strip())
    except ValueError:
        raise InventoryError(
            f"--simulate-gpus {spec!r}: {count_text!r} is not a card count (expected N or N:80GB,...)"
        ) from None
    if count < 0:
        raise InventoryError(f"--simulate-gpus {spec!r}: card count {count} is negative")
    if not _:
        return [Card(str(i)) for i in range(count)]
    try:
        memories = [parse_memory(part.strip()) for part in memories_text.split(",")]
    except RequirementError as exc:
        raise InventoryError(f"--simulate-gpus {spec!r}: {exc}") from None
    if len(memories) == 1:
        memories *= count
    if len(memories) != count:
        raise InventoryError(
            f"--simulate-gpus {spec!r}: {count} cards but {len(memories)} memory sizes"
        )
    return [Card(str(i), memory) for i, memory in enumerate(memories)]


def select_cards(cards: Sequence[Card], wanted: Sequence[str] | None) -> list[Card]:
    """Restrict ``cards`` to the ids in ``wanted`` (``--gpus``), in the order given."""
    if wanted is None:
        return list(cards)
    by_id = {card.id: card for card in cards}
    missing = [card_id for card_id in wanted if card_id not in by_id]
    if missing:
        have = ",".join(by_id) or "none"
        raise InventoryError(
            f"--gpus names card(s) {','.join(missing)} that do not exist (available: {have})"
        )
    if len(set(wanted)) != len(wanted):
        raise InventoryError(f"--gpus names a card twice: {','.join(wanted)}")
    return [by_id[card_id] for card_id in wanted]


def visible_filter(
    cards: Sequence[Card], uuids: Mapping[str, str], env_value: str | None
) -> list[Card]:
    """Apply an outer ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) to physical cards.

    Like CUDA, parsing stops at the first entry that names no card.
    """
    if env_value is None:
        return list(cards)
    by_id = {card.id: card for card in cards}
    by_uuid = {uuid: by_id[index] for index, uuid in uuids.items() if index in by_id}
    visible: list[Card] = []
    for entry in (part.strip() for part in env_value.split(",")):
        card = by_id.get(entry) or by_uuid.get(entry)
        if card is None:
            break
        visible.append(card)
    return visible


def nvml_cards() -> tuple[list[Card], dict[str, str]]:
    """Physical cards (index, total memory) and their UUIDs; empty when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return [], {}
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no library: a machine without GPUs
        return [], {}
    try:
        cards, uuids = [], {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            cards.append(Card(str(index), int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)))
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuids[str(index)] = uuid.decode() if isinstance(uuid, bytes) else uuid
        return cards, uuids
    finally:
        pynvml.nvmlShutdown()


def discover(simulate: list[Card] | None, wanted: Sequence[str] | None) -> list[Card]:
    """The cards for this run: simulated ones, or real ones seen through NVML."""
    if simulate is not None:
        return select_cards(simulate, wanted)
    cards, uuids = nvml_cards()
    return select_cards(
        visible_filter(cards, uuids, os.environ.get("CUDA_VISIBLE_DEVICES")), wanted
    )


def visible_gpu_count() -> int:
    """GPUs this process may use, as the plugin's skip check counts them.

    Inside a gpusched child on simulated cards (``GPUSCHED_SIMULATED=1``) the
    count is the number of ids in ``CUDA_VISIBLE_DEVICES``; otherwise NVML's
    cards filtered by that variable.
    """
    env_value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if os.environ.get("GPUSCHED_SIMULATED") == "1":
        return len([part for part in (env_value or "").split(",") if part.strip()])
    cards, uuids = nvml_cards()
    return len(visible_filter(cards, uuids, env_value))
