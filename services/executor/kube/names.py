"""Names, labels and annotations of the objects the backend creates. Deterministic, so a
redelivered placement names the same objects again (and the API answers 409 instead of
creating them twice), and always valid as Kubernetes names and label values."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

PREFIX = "quartermaster.io/"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGER = "quartermaster"
CLUSTER = PREFIX + "cluster"
JOB = PREFIX + "job"
ATTEMPT = PREFIX + "attempt"
EPOCH = PREFIX + "epoch"
REPLICA = PREFIX + "replica"
REPLICAS = PREFIX + "replicas"
TENANT = PREFIX + "tenant"
PROJECT = PREFIX + "project"
QUEUE = PREFIX + "queue"
GRACE = PREFIX + "grace-s"
CHECKPOINT = PREFIX + "checkpoint-requested"
CHECKPOINT_STOP_AT = PREFIX + "checkpoint-stop-at"
GATE = PREFIX + "gang"  # the scheduling gate held until every member of the gang exists

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_MAX_LABEL = 63


def digest(raw: str, length: int = 10) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()[:length]


def label_value(raw: str) -> str:
    """`raw` if it is a valid label value, else a readable prefix and a hash of the whole (the
    raw value goes in an annotation beside it)."""
    if len(raw) <= _MAX_LABEL and _LABEL_VALUE.match(raw):
        return raw
    readable = re.sub(r"[^A-Za-z0-9_.-]", "-", raw)[:40].strip("-_.")
    return f"{readable}-{digest(raw)}" if readable else f"h-{digest(raw)}"


def slug(raw: str, length: int) -> str:
    """A DNS label piece: lowercase letters, digits and dashes, at most `length`."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", raw.lower()))[:length].strip("-")


@dataclass(frozen=True)
class GangNames:
    """The names of one attempt of a job: its headless Service and one pod per replica."""

    job_id: str
    attempt: int

    @property
    def service(self) -> str:
        # DNS-1035 label (<= 63, starts with a letter): "qm-" + slug + hash + attempt.
        piece = slug(self.job_id, 32)
        return f"qm-{piece + '-' if piece else ''}{digest(self.job_id, 8)}-a{self.attempt}"

    def pod(self, replica: int) -> str:
        return f"{self.service}-r{replica}"

    @staticmethod
    def hostname(replica: int) -> str:
        """The pod's hostname under the Service: peers reach it as `<hostname>.<service>`."""
        return f"r{replica}"

    def address(self, replica: int, namespace: str) -> str:
        return f"{self.hostname(replica)}.{self.service}.{namespace}.svc"


def gang_selector(cluster: str, job_id: str | None = None, attempt: int | None = None) -> str:
    """A label selector for the objects this executor manages (pods, and its pools' requests
    and templates), or for the pods of one job, of one attempt."""
    terms = [f"{MANAGED_BY}={MANAGER}", f"{CLUSTER}={label_value(cluster)}"]
    if job_id is not None:
        terms.append(f"{JOB}={label_value(job_id)}")
    if attempt is not None:
        terms.append(f"{ATTEMPT}={attempt}")
    return ",".join(terms)
