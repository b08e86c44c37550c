"""What a runtime says about a workload, checked and frozen before the policies see it.

Pure data beside `identity` (a workload's `meta`), below the runtime adapters that fill it in
(nodeagent.runtimes) and the policies that read it.

Every answer is bounded before it is kept: at most MAX_ENTRIES labels (or annotations), keys of
at most MAX_KEY_BYTES, values of at most MAX_VALUE_BYTES, valid UTF-8 throughout. An answer
outside these bounds is refused whole (`BadAnswer`), never truncated: a truncated label set could
make a rule read a workload differently from what its owner declared. The bounds are far above
what Kubernetes itself allows (label values of 63 characters, 256 KiB of annotations in all), so
only a hostile or broken runtime meets them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from nodeagent.errors import NodeagentError

MAX_ENTRIES = 1024
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 256 * 1024
MAX_NAME_BYTES = 4096
"""Names, namespaces, images and ids."""
MAX_ANSWER_BYTES = 4 << 20
"""One answer (an HTTP body, a gRPC message): more is refused before it is parsed."""


class BadAnswer(NodeagentError):
    """A runtime's answer about one container is outside the bounds, or not what its API says:
    that container gets no metadata; the runtime is not at fault for the others."""


class Unavailable(NodeagentError):
    """The runtime did not answer (no socket, refused, timed out, reset mid-answer)."""


@dataclass(frozen=True, slots=True)
class Labels(Mapping[str, str]):
    """An immutable, hashable mapping of checked labels or annotations, sorted by key."""

    items_: tuple[tuple[str, str], ...] = ()

    def __getitem__(self, key: str) -> str:
        for k, v in self.items_:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self.items_)

    def __len__(self) -> int:
        return len(self.items_)

    def __repr__(self) -> str:
        return f"Labels({dict(self.items_)!r})"


EMPTY = Labels()


def _text(value: object, what: str, limit: int) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise BadAnswer(f"{what} is not valid UTF-8") from None
    if not isinstance(value, str):
        raise BadAnswer(f"{what} is not a string")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate (JSON's \\ud800): not text
        raise BadAnswer(f"{what} is not valid UTF-8") from None
    if size > limit:
        raise BadAnswer(f"{what} is {size} bytes, more than {limit}")
    return value


def name(value: object, what: str) -> str:
    """A checked name, image or id."""
    return _text(value, what, MAX_NAME_BYTES)


def optional_name(value: object, what: str) -> str | None:
    if value is None or value == "":
        return None
    return name(value, what)


def labels(value: object, what: str = "labels") -> Labels:
    """Checked labels from an answer's mapping (None or absent: none)."""
    if value is None:
        return EMPTY
    if not isinstance(value, Mapping):
        raise BadAnswer(f"{what} is not a mapping")
    if len(value) > MAX_ENTRIES:
        raise BadAnswer(f"{len(value)} {what}, more than {MAX_ENTRIES}")
    out = {}
    for k, v in value.items():
        key = _text(k, f"a key of {what}", MAX_KEY_BYTES)
        out[key] = _text(v, f"{what}[{key[:64]!r}]", MAX_VALUE_BYTES)
    return Labels(tuple(sorted(out.items())))


@dataclass(frozen=True, slots=True)
class PodMeta:
    """A Kubernetes pod, as the kubelet gave it to the runtime (the pod's labels and
    annotations are copied onto its sandbox)."""

    namespace: str
    name: str
    uid: str | None = None
    labels: Labels = EMPTY
    annotations: Labels = EMPTY


@dataclass(frozen=True, slots=True)
class ContainerMeta:
    """A workload as its runtime names it. `name` is None for a pod's own cgroup and its
    sandbox ("pause") container, which have no container name."""

    runtime: str
    name: str | None = None
    image: str | None = None
    labels: Labels = EMPTY
    annotations: Labels = EMPTY
    pod: PodMeta | None = None
    sandbox: bool = False
    """The pod's sandbox ("pause") container, not one of its own."""
    incomplete: str | None = None
    """What the runtime could not say (podman without its API: the labels), so that a rule
    on it does not match, and why."""

    def to_json(self) -> dict[str, object]:
        pod = self.pod
        return {
            "name": self.name,
            "image": self.image,
            "labels": dict(self.labels),
            "annotations": dict(self.annotations),
            "sandbox": self.sandbox,
            "incomplete": self.incomplete,
            "pod": None
            if pod is None
            else {
                "namespace": pod.namespace,
                "name": pod.name,
                "uid": pod.uid,
                "labels": dict(pod.labels),
                "annotations": dict(pod.annotations),
            },
        }
