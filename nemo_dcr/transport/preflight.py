"""Is a store usable?  One check before anything starts (:func:`check_store`).

A store that cannot be used should be refused while the command line is still being read:
exit status 2, nothing written, no process started.  Before this check, a mistyped
directory was created and waited on forever, and an ``s3://`` store with a wrong endpoint,
wrong credentials or a missing bucket was found only once the trainer ran (exit 1, a run
directory left behind).

What is checked (``docs/object-stores.md`` lists every message):

- a local directory (a plain path or ``file://``): for a reader (``reader=True``: a
  receiver, ``nemo-dcr status``) it must exist and be a directory -- a reader never creates
  it (``open_store(..., create=False)``); for the trainer it may be missing (it is created),
  but a path that exists must be a directory;
- ``s3://`` / ``s3a://``: the endpoint (``endpoint_url`` in the storage options or their
  ``client_kwargs``, else ``$AWS_ENDPOINT_URL_S3`` / ``$AWS_ENDPOINT_URL``, else AWS), the
  credentials (botocore's chain: the storage options' ``key`` / ``secret``, then
  ``$AWS_ACCESS_KEY_ID`` / ``$AWS_SECRET_ACCESS_KEY``, ``$AWS_PROFILE`` and the shared files,
  ...; ``anon=True`` skips them) and the region (``client_kwargs={"region_name": ...}``, else
  ``$AWS_DEFAULT_REGION`` / ``$AWS_REGION`` / the profile's): one ``ListObjectsV2`` of at most
  one key under the store's prefix, which needs the bucket to exist, the credentials to be
  valid, the region to be the bucket's and read permission, and writes nothing;
- an ordered upstream list (``a,b,...``): each member that is a directory or an ``s3://``
  URI, as above; relays (``relay://``, ``http(s)://``) are not asked (they may start after
  the receiver that reads them);
- other schemes (``memory://``, ``gs://``, ...): only that fsspec can open them.

Each refusal is a :class:`StoreUnusable` (a ``ValidationError``) whose message is one line
naming the store, what is wrong and how to fix it.
"""
from __future__ import annotations

import os

from nemo_dcr.errors import DcrError, ValidationError

_S3 = ("s3", "s3a")
_RELAY = ("relay", "http", "https")
DEFAULT_TIMEOUT_S = 10.0
"""How long the S3 check waits for the endpoint (connect and read, one attempt)."""


class StoreUnusable(ValidationError):
    """The store cannot be used as given; ``str(e)`` is one line with the fix."""


def check_store(uri: str, *, reader: bool, timeout_s: float = DEFAULT_TIMEOUT_S, **options) -> None:
    """Refuse (``StoreUnusable``, one line) a store ``uri`` that cannot be used; return None
    when it can.  ``reader``: a receiver (the store must already exist) rather than the
    trainer (a missing local directory is created by it).  ``options``: the fsspec storage
    options the store is opened with (``endpoint_url``, ``key``, ``secret``, ``anon``,
    ``client_kwargs``, ...).  Writes nothing, anywhere."""
    if not isinstance(uri, str) or not uri.strip():
        raise StoreUnusable(f"store URI must be a non-empty string, got {uri!r}")
    if "," in uri:
        for part in (u.strip() for u in uri.split(",")):
            if part:
                check_store(part, reader=reader, timeout_s=timeout_s, **options)
        return
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme in ("", "file"):
        _check_dir(uri, reader=reader)
    elif scheme in _S3:
        _check_s3(uri, timeout_s=timeout_s, **options)
    elif scheme not in _RELAY:
        from nemo_dcr.transport.store import open_store

        try:
            open_store(uri, **options)
        except DcrError as e:
            raise StoreUnusable(f"store {' '.join(str(e).split())}: check the URI's scheme, and that the fsspec "
                                "package for it is installed") from None


def _check_dir(uri: str, *, reader: bool) -> None:
    root = os.path.abspath(uri.removeprefix("file://"))
    if os.path.isdir(root):
        if reader and not os.access(root, os.R_OK | os.X_OK):
            raise StoreUnusable(f"store {uri}: the directory {root} cannot be read by this user: fix its permissions")
        return
    if os.path.exists(root):
        raise StoreUnusable(f"store {uri}: {root} is not a directory: give the store's directory")
    if reader:
        raise StoreUnusable(f"store {uri}: no such directory ({root}); a receiver never creates its store: give the "
                            "directory the trainer writes to (refit.store_uri / store.uri), or create it first")


def _endpoint(options: dict) -> tuple[str | None, str]:
    """The endpoint URL the S3 client will use, and where it came from."""
    client_kwargs = options.get("client_kwargs") or {}
    for source, value in (("storage option endpoint_url", options.get("endpoint_url")),
                          ("storage option client_kwargs.endpoint_url", client_kwargs.get("endpoint_url")),
                          ("$AWS_ENDPOINT_URL_S3", os.environ.get("AWS_ENDPOINT_URL_S3")),
                          ("$AWS_ENDPOINT_URL", os.environ.get("AWS_ENDPOINT_URL"))):
        if value:
            return value, source
    return None, "AWS (no endpoint_url option, no $AWS_ENDPOINT_URL)"


def _check_s3(uri: str, *, timeout_s: float, **options) -> None:
    try:
        import botocore.session
        from botocore import UNSIGNED
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError, EndpointConnectionError, NoRegionError
    except ImportError:
        raise StoreUnusable(f"store {uri}: s3:// stores need s3fs (and botocore): pip install s3fs") from None
    path = uri.split("://", 1)[1]
    bucket, _, prefix = path.partition("/")
    if not bucket:
        raise StoreUnusable(f"store {uri}: no bucket in the URI: write it as s3://BUCKET/PREFIX")
    endpoint, endpoint_from = _endpoint(options)
    where = f"endpoint {endpoint} (from {endpoint_from})" if endpoint else endpoint_from
    session = botocore.session.get_session()
    client_kwargs = dict(options.get("client_kwargs") or {})
    region = client_kwargs.get("region_name") or session.get_config_variable("region")
    anon = bool(options.get("anon"))
    key, secret = options.get("key"), options.get("secret")
    if not anon and not (key and secret):
        creds = session.get_credentials()
        if creds is None:
            raise StoreUnusable(
                f"store {uri}: no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "AWS_PROFILE with ~/.aws/credentials), or open a public bucket with the storage option anon=True")
        key = creds.access_key
    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"total_max_attempts": 1},
                    signature_version=UNSIGNED if anon else None)
    try:
        client = session.create_client("s3", endpoint_url=endpoint, region_name=region, config=config,
                                       aws_access_key_id=options.get("key"), aws_secret_access_key=options.get("secret"),
                                       aws_session_token=options.get("token"))
    except (BotoCoreError, ValueError) as e:  # a malformed endpoint URL, an unknown region name
        raise StoreUnusable(f"store {uri}: cannot make an S3 client for {where}: {_line(e)}: fix the endpoint "
                            "URL (http(s)://host:port) or the region") from None
    listed = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
    try:
        client.list_objects_v2(Bucket=bucket, Prefix=listed, MaxKeys=1)
    except EndpointConnectionError as e:
        raise StoreUnusable(f"store {uri}: cannot reach the S3 {where}: {_line(e)}: check that the server is up and "
                            "the URL (set AWS_ENDPOINT_URL, or the storage option endpoint_url)") from None
    except NoRegionError:
        raise StoreUnusable(f"store {uri}: no S3 region configured: set AWS_DEFAULT_REGION (the bucket's region)"
                            ) from None
    except ClientError as e:
        raise StoreUnusable(_client_error(uri, bucket, where, region, key, e)) from None
    except BotoCoreError as e:  # timeouts, SSL, proxy, malformed answers
        raise StoreUnusable(f"store {uri}: the S3 {where} did not answer a listing of bucket {bucket!r} within "
                            f"{timeout_s:g}s ({_line(e)}): check the URL and that the server is up") from None


def _client_error(uri: str, bucket: str, where: str, region: str | None, key: str | None, e) -> str:
    err = e.response.get("Error", {}) if hasattr(e, "response") else {}
    code = str(err.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") if hasattr(e, "response") else None
    headers = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}) if hasattr(e, "response") else {}
    key_hint = f" (access key {key[:4]}...{key[-2:]})" if key and len(key) > 8 else (f" (access key {key})" if key
                                                                                      else "")
    if code in ("NoSuchBucket",) or status == 404:
        return (f"store {uri}: bucket {bucket!r} does not exist at the S3 {where}: create it (aws s3 mb s3://{bucket}) "
                "or fix the bucket name / the endpoint")
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "TokenRefreshRequired",
                "InvalidClientTokenId"):
        return (f"store {uri}: the S3 {where} refused the credentials{key_hint} ({code}): set the right "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    bucket_region = headers.get("x-amz-bucket-region") or err.get("Region")
    if code in ("AuthorizationHeaderMalformed", "PermanentRedirect", "IllegalLocationConstraintException") or (
            status == 301) or (bucket_region and region and bucket_region != region):
        there = f"region {bucket_region!r}" if bucket_region else "another region"
        return (f"store {uri}: bucket {bucket!r} is in {there}, not {region or 'the default region'!r} ({code or status})"
                f": set AWS_DEFAULT_REGION={bucket_region or '<the bucket region>'}")
    if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
        return (f"store {uri}: access to bucket {bucket!r} denied for the credentials{key_hint} at the S3 {where} "
                f"({code or status}): grant them s3:ListBucket, s3:GetObject and, for the trainer, s3:PutObject")
    return f"store {uri}: the S3 {where} refused a listing of bucket {bucket!r}: {code or status}: {_line(e)}"


def _line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
