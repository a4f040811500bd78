"""`specdec grafana provision`: put the Prometheus data source and the dashboard into a
Grafana, idempotently (a second run changes nothing), through grafana-client.

grafana-client is the maintained continuation of the `grafana-api` package (same
`GrafanaApi` class and element API; grafana-api has had no release since 2021 and does not
know Grafana's newer folder and data source endpoints).
"""

from __future__ import annotations

import dataclasses

from grafana_client import GrafanaApi
from grafana_client.client import (
    GrafanaClientError,
    GrafanaException,
    GrafanaServerError,
    GrafanaTimeoutError,
    GrafanaUnauthorizedError,
)

from specdec_tools.dashboard import DATASOURCE_UID, UID, build


class ProvisionError(RuntimeError):
    pass


@dataclasses.dataclass
class Result:
    datasource: str   # created | updated | unchanged
    folder: str
    dashboard: str
    url: str


def datasource_body(prometheus_url: str) -> dict:
    return {"uid": DATASOURCE_UID, "name": "specdec Prometheus", "type": "prometheus",
            "access": "proxy", "url": prometheus_url, "isDefault": False,
            "jsonData": {"httpMethod": "POST", "timeInterval": "5s"}}


def _differs(have: dict, want: dict) -> bool:
    return any(have.get(k) != v for k, v in want.items())


def _missing(call) -> dict | None:
    """The answer of a GET, or None where Grafana says 404."""
    try:
        return call()
    except GrafanaClientError as exc:
        if getattr(exc, "status_code", None) == 404:
            return None
        raise


def provision(url: str, credential, prometheus_url: str, folder: str = "specdec",
              timeout_s: float = 10.0) -> Result:
    api = GrafanaApi.from_url(url=url, credential=credential, timeout=timeout_s)
    try:
        return _provision(api, url, prometheus_url, folder)
    except GrafanaUnauthorizedError as exc:
        raise ProvisionError(f"Grafana at {url} refused the credentials ({exc.status_code}): "
                             "check --token, or --user and --password") from None
    except GrafanaTimeoutError:
        raise ProvisionError(f"Grafana at {url} did not answer within {timeout_s:g} s: is it "
                             "up, and is the URL right?") from None
    except GrafanaServerError as exc:
        raise ProvisionError(f"Grafana at {url} failed ({exc.status_code}: {exc.message}): "
                             "is it up and healthy?") from None
    except GrafanaException as exc:
        raise ProvisionError(f"Grafana at {url} refused a request ({exc.status_code}: "
                             f"{exc.message})") from None
    except OSError as exc:  # connection refused, unknown host: niquests' errors are OSErrors
        raise ProvisionError(f"cannot reach Grafana at {url}: {exc}") from None


def _provision(api: GrafanaApi, url: str, prometheus_url: str, folder: str) -> Result:
    want_ds = datasource_body(prometheus_url)
    have_ds = _missing(lambda: api.datasource.get_datasource_by_uid(DATASOURCE_UID))
    if have_ds is None:
        api.datasource.create_datasource(want_ds)
        ds = "created"
    elif _differs(have_ds, want_ds):
        api.datasource.update_datasource_by_uid(DATASOURCE_UID, want_ds)
        ds = "updated"
    else:
        ds = "unchanged"

    folder_uid = folder.lower().replace(" ", "-")
    if _missing(lambda: api.folder.get_folder(folder_uid)) is None:
        api.folder.create_folder(folder, uid=folder_uid)
        fo = "created"
    else:
        fo = "unchanged"

    want = build()
    have = _missing(lambda: api.dashboard.get_dashboard(UID))
    if have is None:
        db = "created"
    else:
        current = {k: v for k, v in have.get("dashboard", {}).items() if k not in ("id", "version")}
        same_folder = (have.get("meta") or {}).get("folderUid") == folder_uid
        db = "unchanged" if current == want and same_folder else "updated"
    if db != "unchanged":
        api.dashboard.update_dashboard({"dashboard": want, "folderUid": folder_uid,
                                        "overwrite": True,
                                        "message": "specdec grafana provision"})
    return Result(ds, fo, db, f"{url.rstrip('/')}/d/{UID}")
