"""The load generator's tests run it against a real server: the service tests' fixtures."""

from tests.service.conftest import vbs_cache  # noqa: F401 - the session's profile cache
