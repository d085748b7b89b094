"""Two snapshots of the same program compared (``memsentry diff a.pickle b.pickle``): the peak
and the end of each device, what each line of the user's code held at the end, and the
findings that appeared or went. Pure functions of two verdicts and their findings."""

from __future__ import annotations

from dataclasses import dataclass

from memsentry.model import Finding, Severity
from memsentry.snapshots.judge import DeviceVerdict, SnapshotVerdict
from memsentry.units import format_bytes


@dataclass(frozen=True)
class SiteChange:
    """What one line held at the end of each record (bytes; 0 where it held nothing)."""

    site: str | None
    old: int
    new: int

    @property
    def delta(self) -> int:
        return self.new - self.old


@dataclass(frozen=True)
class DeviceChange:
    """One device in both records (``None``: not in that one)."""

    name: str
    old_peak: int | None
    new_peak: int | None
    old_end: int | None
    new_end: int | None
    sites: tuple[SiteChange, ...]


@dataclass(frozen=True)
class SnapshotDiff:
    old_path: str
    new_path: str
    devices: tuple[DeviceChange, ...]
    appeared: tuple[Finding, ...]
    disappeared: tuple[Finding, ...]

    @property
    def peak_change(self) -> tuple[int, int] | None:
        """(old, new) highest peak over the devices both records have; ``None`` without one."""
        both = [(d.old_peak, d.new_peak) for d in self.devices
                if d.old_peak is not None and d.new_peak is not None]
        if not both:
            return None
        return max(old for old, _new in both), max(new for _old, new in both)


def compare(old: SnapshotVerdict, old_findings: tuple[Finding, ...], new: SnapshotVerdict,
            new_findings: tuple[Finding, ...], *, top: int = 10) -> SnapshotDiff:
    """``new`` against ``old``: devices by name, the ``top`` lines whose bytes at the end
    changed most, findings matched by rule, device and line (not by their text)."""
    olds = {device.name: device for device in old.devices}
    news = {device.name: device for device in new.devices}
    names = list(news) + [name for name in olds if name not in news]
    devices = tuple(_device(name, olds.get(name), news.get(name), top) for name in names)
    return SnapshotDiff(old_path=old.path, new_path=new.path, devices=devices,
                        appeared=_unmatched(new_findings, old_findings),
                        disappeared=_unmatched(old_findings, new_findings))


def _unmatched(found: tuple[Finding, ...], others: tuple[Finding, ...]) -> tuple[Finding, ...]:
    """The findings of ``found`` that ``others`` has none of (by :func:`_key`)."""
    keys = {_key(finding) for finding in others}
    return tuple(finding for finding in found if _key(finding) not in keys)


def _key(finding: Finding) -> tuple[str, str | None, str | None]:
    subject = finding.subject.name if finding.subject else None
    return finding.rule, subject, str(finding.location) if finding.location else None


def _device(name: str, old: DeviceVerdict | None, new: DeviceVerdict | None, top: int
            ) -> DeviceChange:
    held_old = _held(old)
    held_new = _held(new)
    sites = [SiteChange(site, held_old.get(site, 0), held_new.get(site, 0))
             for site in {*held_old, *held_new}]
    sites = [change for change in sites if change.delta]
    sites.sort(key=lambda change: (-abs(change.delta), change.site or ""))
    return DeviceChange(name=name, old_peak=old.peak if old else None,
                        new_peak=new.peak if new else None, old_end=old.end if old else None,
                        new_end=new.end if new else None, sites=tuple(sites[:top]))


def _held(device: DeviceVerdict | None) -> dict[str | None, int]:
    found: dict[str | None, int] = {}
    for site in device.sites_at_end if device else ():
        found[site.site] = found.get(site.site, 0) + site.bytes
    return found


def breaches(change: SnapshotDiff, *, peak_share: float | None, peak_bytes: int | None,
             new_findings: bool) -> tuple[str, ...]:
    """What crosses the limits given, each said with the figure and the limit: the highest
    peak rising by more than ``peak_share`` of the old one or by more than ``peak_bytes``,
    and (``new_findings``) a leak or waste finding the old record did not have."""
    said: list[str] = []
    peaks = change.peak_change
    if peaks is not None:
        said += _peak_breaches(*peaks, peak_share, peak_bytes)
    if new_findings:
        said += [f"--fail-on-new-findings: new {f.severity.value.upper()} {f.rule} "
                 f"{_where(f)}" for f in new_serious(change)]
    return tuple(said)


def _where(finding: Finding) -> str:
    if finding.location is not None:
        return f"at {finding.location}"
    return f"on {finding.subject.name}" if finding.subject is not None else ""


def _peak_breaches(old: int, new: int, share: float | None, size: int | None) -> list[str]:
    rise = new - old
    said = []
    if size is not None and rise > size:
        said.append(f"--max-peak-increase: the peak rose by {format_bytes(rise)} "
                    f"({format_bytes(old)} to {format_bytes(new)}), past {format_bytes(size)}")
    if share is not None and old > 0 and rise > share * old:
        said.append(f"--max-peak-increase: the peak rose by {rise / old:.1%} "
                    f"({format_bytes(old)} to {format_bytes(new)}), past {share:.1%}")
    return said


def new_serious(change: SnapshotDiff) -> tuple[Finding, ...]:
    """The findings that appeared and are a leak or a waste (hints do not count)."""
    return tuple(f for f in change.appeared if f.severity in (Severity.LEAK, Severity.WASTE))


__all__ = ["DeviceChange", "SiteChange", "SnapshotDiff", "breaches", "compare", "new_serious"]
