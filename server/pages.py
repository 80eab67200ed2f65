"""The HTML pages (Jinja2 templates, charts as inline SVG from `charts`). Each has a JSON twin in `api`."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from rewy_tune.problem import OPS

from . import charts, views
from .api import SHAPE_PATTERN, CampaignId, DevicePath, Offset, Op, Parameter, TrialStatus, parse_devices
from .views import NotFound

templates = Jinja2Templates(directory=str(Path(__file__).resolve().parent / "templates"))
templates.env.globals.update(OPS=OPS, status_colour=charts.colour)


def _ms(value: float | None) -> str:
    value = views.finite(value)
    return "—" if value is None else (f"{value:.4g}")


def _x(value: float | None) -> str:
    value = views.finite(value)
    return "—" if value is None else f"{value:.2f}×"


def _seconds(value: float | None) -> str:
    value = views.finite(value)
    return "—" if value is None else f"{value:.1f}"


templates.env.filters.update(ms=_ms, times=_x, seconds=_seconds, utc=views.utc_text, budget=views.budget_text,
                             ago=views.ago_text, gates=views.gate_summary)

router = APIRouter(include_in_schema=False)


def render(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> HTMLResponse:
    state = request.app.state.dashboard
    return templates.TemplateResponse(request, name, {"database": state.label, **context}, status_code=status_code)


def _empty(request: Request) -> HTMLResponse:
    state = request.app.state.dashboard
    return render(request, "empty.html", {"error": state.error, "url": state.url})


@router.get("/", response_class=HTMLResponse)
def overview_page(request: Request):
    with request.app.state.dashboard.session() as s:
        if s is None or views.is_empty(s):
            return _empty(request)
        return render(request, "overview.html", views.overview(s))


@router.get("/devices/{device}/{op}", response_class=HTMLResponse)
def device_page(request: Request, device: DevicePath, op: Op,
                shape: Annotated[str | None, Query(pattern=SHAPE_PATTERN)] = None, param: Parameter | None = None):
    with request.app.state.dashboard.session() as s:
        if s is None:
            return _empty(request)
        data = views.device_op(s, device, op, shape, param)
    points, flats, timed = data["_points"], data["_flats"], data["_timed"]
    shape, param = data["shape"], data["parameter"]
    svg = {}
    if shape and param and timed:
        svg["scatter"] = charts.scatter_by_parameter(
            [(f.get(param), timed.get(p.id), p.status) for p, f in zip(points, flats)],
            x_label=param, y_label=f"median latency at {shape} (ms, log)",
            title=f"{len(points)} trials: latency against {param}")
        svg["history"] = charts.history(
            [(i, timed.get(p.id), p.status) for i, p in enumerate(points)],
            x_label="trial (campaigns in order)", y_label=f"latency at {shape} (ms, log)",
            title="every trial and the best so far")
    if data["status_counts"]:
        svg["failures"] = charts.bars(list(data["status_counts"].items()), "trials by status",
                                      colours=charts.STATUS_COLOURS)
    if data["importance"]:
        svg["importance"] = charts.bars([(r["parameter"], 100 * r["importance"]) for r in data["importance"][:12]],
                                        "parameter importance", value_format="{:.1f}%")
    return render(request, "device.html", {**data, "svg": svg})


@router.get("/compare", response_class=HTMLResponse)
def compare_page(request: Request, op: Op | None = None, devices: Annotated[list[str] | None, Query()] = None):
    with request.app.state.dashboard.session() as s:
        if s is None or views.is_empty(s):
            return _empty(request)
        known = views.device_list(s)
        with_data = [o for o in OPS if any(o in d["ops"] for d in known)]
        context = {"known": known, "data": None, "op": op or (with_data[0] if with_data else OPS[1]), "error": None}
        if op is None or not devices:
            return render(request, "compare.html", context)
        try:
            names = parse_devices(devices)
        except HTTPException as exc:  # the HTML form gets an HTML answer; the API keeps its JSON 422
            return render(request, "compare.html", context | {"error": exc.detail}, status_code=422)
        data = views.compare(s, op, names)
    return render(request, "compare.html", context | {"data": data})


TrialsPageLimit = Annotated[int, Query(ge=1, le=500)]


@router.get("/campaigns/{campaign_id}", response_class=HTMLResponse)
def campaign_page(request: Request, campaign_id: CampaignId, status: TrialStatus | None = None,
                  offset: Offset = 0, limit: TrialsPageLimit = 50):
    with request.app.state.dashboard.session() as s:
        if s is None:
            raise NotFound(f"no campaign with id {campaign_id}: the database is empty")
        data = views.campaign_detail(s, campaign_id)
        trials = views.trials_page(s, campaign_id, status=status, offset=offset, limit=limit)
    points, shape, timed = data["_points"], data["_shape"], data["_timed"]
    svg = None
    if points and shape:
        start = data["campaign"]["started_at"]
        t0 = datetime.fromisoformat(start) if start else points[0].created_at
        svg = charts.history([((p.created_at - t0).total_seconds(), timed.get(p.id), p.status)
                              for p in points], x_label="seconds since the campaign started",
                             y_label=f"latency at {shape} (ms, log)", title="timeline")
    fla = {r["shape"]: r["fla_ms"] for r in data["shapes"]}
    return render(request, "campaign.html", {**data, "svg": svg, "shape": shape, "trials": trials, "fla": fla,
                                             "status_filter": status})
