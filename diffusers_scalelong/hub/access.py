"""Reaching the Hub: one clear error line when the endpoint does not answer or refuses the credentials.

``huggingface_hub`` reports an unreachable endpoint with its HTTP client's transport error, whose traceback runs
through a dozen frames of the client. Every function of this package that talks to the Hub is wrapped by
:func:`reports_unreachable_hub`, which turns that error into :class:`HubAccessError` (an ``OSError``) naming the
endpoint, without the chained frames. :func:`check_hub_access` checks, before a long job that ends in a push, that
the endpoint answers, the credentials are accepted and not read-only, and the repository exists or can be created.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from huggingface_hub import HfApi, constants
from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

try:  # the HTTP client of huggingface_hub 2.x
    from httpx2 import HTTPError as _ClientError
except ImportError:  # huggingface_hub 1.x
    from httpx import HTTPError as _ClientError

F = TypeVar("F", bound=Callable)


class HubAccessError(OSError):
    """The Hub endpoint could not be reached, or it refused the credentials or the repository."""


def _where(endpoint: str | None) -> str:
    return (endpoint or constants.ENDPOINT).rstrip("/")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


@contextmanager
def hub_errors(endpoint: str | None = None) -> Iterator[None]:
    """Turn the HTTP client's transport errors (refused connection, unknown host, timeout) into
    :class:`HubAccessError` naming ``endpoint``; the Hub's own answers (``HfHubHTTPError``) pass unchanged."""
    try:
        yield
    except HfHubHTTPError:
        raise
    except _ClientError as error:
        raise HubAccessError(
            f"cannot reach the Hub at {_where(endpoint)}: {_first_line(error)} (check the network, or HF_ENDPOINT)"
        ) from None


def reports_unreachable_hub(function: F) -> F:
    """Decorate a function with an optional ``endpoint`` argument so that it raises :class:`HubAccessError`
    (see :func:`hub_errors`) when that endpoint cannot be reached."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        endpoint = signature.bind_partial(*args, **kwargs).arguments.get("endpoint")
        with hub_errors(endpoint):
            return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def check_hub_access(
    repo_id: str, *, private: bool | None = None, endpoint: str | None = None, token: str | None = None
) -> str:
    """Check that a push to ``repo_id`` can succeed, before the work that produces it; returns the user name.

    Asks the endpoint who the credentials belong to (``whoami``), refuses a read-only token, and creates the
    repository if it is missing (``exist_ok``). Raises :class:`HubAccessError` with one line naming the endpoint.
    Credentials and endpoint default to the ``huggingface_hub`` ones (``HF_TOKEN``/saved login, ``HF_ENDPOINT``).
    """
    where = _where(endpoint)
    api = HfApi(endpoint=endpoint, token=token)
    with hub_errors(endpoint):
        try:
            user = api.whoami()
        except LocalTokenNotFoundError:
            raise HubAccessError(
                f"no Hub credentials to push to {where}: set HF_TOKEN or run `hf auth login`"
            ) from None
        except HfHubHTTPError as error:
            raise HubAccessError(
                f"the Hub at {where} refused the credentials: {_first_line(error)} (set a valid HF_TOKEN)"
            ) from None
        name = str(user.get("name", "?"))
        role = (user.get("auth") or {}).get("accessToken", {}).get("role")
        if role == "read":
            raise HubAccessError(f"the Hub token of {name} at {where} is read-only; pushing needs a write token")
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
        except HfHubHTTPError as error:
            raise HubAccessError(f"cannot create or use {repo_id} on {where} as {name}: {_first_line(error)}") from None
    return name


def hub_user_name(endpoint: str | None = None, token: str | None = None) -> str:
    """The user the credentials belong to (``whoami``); :class:`HubAccessError` with one line when there are none or
    the Hub refuses them."""
    with hub_errors(endpoint):
        try:
            return str(HfApi(endpoint=endpoint, token=token).whoami()["name"])
        except LocalTokenNotFoundError:
            raise HubAccessError(
                f"no Hub credentials for {_where(endpoint)}: set HF_TOKEN or run `hf auth login`"
            ) from None
        except HfHubHTTPError as error:
            raise HubAccessError(
                f"the Hub at {_where(endpoint)} refused the credentials: {_first_line(error)}"
            ) from None
