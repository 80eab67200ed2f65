"""The JSON API: one GET endpoint per dashboard page and the raw lists behind them. Read-only.

Parameters are typed (operators, policies, statuses and schedule parameters are closed sets, device
names and shape labels are patterns), so a bad value is a 422 before any query runs; a well-formed
name or id the database does not hold is a 404. Values only reach bound parameters of ORM queries.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Request

from rewy_tune.db import queries as q
from rewy_tune.db.models import CAMPAIGN_STATUSES, TRIAL_STATUSES
from rewy_tune.problem import OPS, POLICIES

from . import views
from .views import NotFound

Op = Literal[OPS]
Policy = Literal[POLICIES]
TrialStatus = Literal[TRIAL_STATUSES]
CampaignStatus = Literal[CAMPAIGN_STATUSES]
Parameter = Literal[views.SCHEDULE_PARAMETERS]
DEVICE_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
SHAPE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_ID = 2**62  # SQLite integers are 64-bit: larger values are rejected before they reach the driver

DeviceQuery = Annotated[str | None, Query(pattern=DEVICE_PATTERN, description="device short name, e.g. h200")]
DevicePath = Annotated[str, Path(pattern=DEVICE_PATTERN, description="device short name, e.g. h200")]
CampaignId = Annotated[int, Path(ge=1, le=MAX_ID)]
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=MAX_ID)]

router = APIRouter(prefix="/api", tags=["api"])


def _state(request: Request):
    return request.app.state.dashboard


@router.get("/overview", summary="Devices × operators × policies: best speedup, trials, freshness")
def get_overview(request: Request) -> dict[str, Any]:
    state = _state(request)
    with state.session() as s:
        if s is None or views.is_empty(s):
            return {"empty": True, "database": state.label, "database_error": state.error, "rows": [],
                    "devices": [], "campaigns": [], "current_software": views.current_software()}
        return {"empty": False, "database": state.label} | views.overview(s)


@router.get("/devices", summary="Every device in the database")
def get_devices(request: Request) -> list[dict[str, Any]]:
    with _state(request).session() as s:
        return [] if s is None else views.device_list(s)


@router.get("/devices/{device}/ops/{op}", summary="One operator on one device (the device page)")
def get_device_op(request: Request, device: DevicePath, op: Op,
                  shape: Annotated[str | None, Query(pattern=SHAPE_PATTERN)] = None,
                  param: Parameter | None = None) -> dict[str, Any]:
    with _state(request).session() as s:
        if s is None:
            raise NotFound(f"no device named {device!r}: the database is empty")
        return views.public(views.device_op(s, device, op, shape, param))


@router.get("/winners", summary="Promoted winning schedules, filtered by device, operator and policy")
def get_winners(request: Request, device: DeviceQuery = None, op: Op | None = None,
                policy: Policy | None = None) -> list[dict[str, Any]]:
    with _state(request).session() as s:
        if s is None:
            if device is not None:
                raise NotFound(f"no device named {device!r}: the database is empty")
            return []
        if device is not None:
            views._device_ids(s, device)
        names = {d.id: d.short_name for d in q.devices(s)}
        return [views.winner_json(w, names[w.device_id]) for w in q.winners(s, device=device, op=op, policy=policy)]


@router.get("/campaigns", summary="Campaigns, newest first (paginated), each with its activity: finished or "
            "not, trials recorded, when it last recorded a trial")
def get_campaigns(request: Request, device: DeviceQuery = None, op: Op | None = None,
                  status: CampaignStatus | None = None, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
    with _state(request).session() as s:
        if s is None:
            return {"items": [], "total": 0, "limit": limit, "offset": offset}
        items = q.campaigns(s, device=device, op=op, status=status, offset=offset, limit=limit)
        counts = q.trial_counts(s, [c.id for c in items])
        act = views.activities(s, items, counts)
        return {"items": [views.campaign_json(c, counts, act) for c in items],
                "total": q.campaign_count(s, device=device, op=op, status=status), "limit": limit, "offset": offset}


@router.get("/campaigns/{campaign_id}", summary="One campaign: provenance, budget, per-shape results")
def get_campaign(request: Request, campaign_id: CampaignId) -> dict[str, Any]:
    with _state(request).session() as s:
        if s is None:
            raise NotFound(f"no campaign with id {campaign_id}: the database is empty")
        return views.public(views.campaign_detail(s, campaign_id))


@router.get("/campaigns/{campaign_id}/trials", summary="Trials of a campaign in Optuna order (paginated)")
def get_trials(request: Request, campaign_id: CampaignId, status: TrialStatus | None = None,
               limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
    with _state(request).session() as s:
        if s is None or q.get_campaign(s, campaign_id) is None:
            raise NotFound(f"no campaign with id {campaign_id}")
        return views.trials_page(s, campaign_id, status=status, offset=offset, limit=limit)


def parse_devices(devices: list[str]) -> list[str]:
    """`devices=h200,a100` or `devices=h200&devices=a100`: two or more distinct, well-formed names."""
    import re

    names: list[str] = []
    for item in devices:
        for name in item.split(","):
            name = name.strip()
            if not re.fullmatch(DEVICE_PATTERN, name):
                raise HTTPException(422, f"devices: {name[:64]!r} is not a device short name "
                                         "(lowercase letters, digits, '.', '_', '-')")
            if name not in names:
                names.append(name)
    if not 2 <= len(names) <= 8:
        raise HTTPException(422, f"devices: give 2 to 8 distinct devices; got {len(names)}")
    return names


@router.get("/compare", summary="One operator's winning schedules on two or more devices, side by side")
def get_compare(request: Request, op: Op,
                devices: Annotated[list[str], Query(min_length=1, max_length=8,
                                                    description="device short names: repeat or comma-separate")]
                ) -> dict[str, Any]:
    names = parse_devices(devices)
    with _state(request).session() as s:
        if s is None:
            raise NotFound("no devices: the database is empty")
        return views.compare(s, op, names)
