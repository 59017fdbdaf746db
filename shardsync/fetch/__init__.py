"""HTTP: locating files, Range requests, retries, the streaming hash and the resume proof.

The only package that speaks HTTP. Import what you need from its modules; this file
re-exports nothing (each name has one home):

- ``request``: the values other layers pass in and get back (``BlobRequest``, ``Located``,
  ``Locator``, ``Sleep``, ``Throttle``, ``redact_url``...); pure, no aiohttp.
- ``answers``: what an HTTP answer means (status to error, retry, relocation or restart;
  redirects; the Range request's binding to an ETag and the check of its answer).
- ``fetcher``: ``Fetcher``: locating (ahead of time too), small GETs and ranges, the
  backoff, and each file's ``fetch`` with its restarts and relocations; ``session``: its
  aiohttp session's plumbing (redirects by hand, the proxy, headers, timeouts).
- ``transfer``: one attempt at one file (its connections, ramp, hasher, resume record),
  given what it needs of the fetcher in ``Services``.
- ``body``: the ``Body`` protocol, a Range answer's body into the file, and its
  ``Landing``; ``body_wire`` (our sockets, ``wire``, read by the file's ``pump``) and
  ``body_aiohttp`` (proxied, chunked, whole-file) implement it.
- ``disk``: positioned writes of body bytes, and writeback.

Imports run one way: ``fetcher`` -> ``session``, ``transfer`` and the two bodies (it picks
each file's body path); ``transfer`` -> ``body``, ``answers``, ``request`` (never a body
implementation); ``body_wire``, ``body_aiohttp`` -> ``body``, ``answers``, ``request`` and
their own ``wire``, ``pump``, ``disk``; ``answers`` -> ``request`` -> pure modules only.
"""
