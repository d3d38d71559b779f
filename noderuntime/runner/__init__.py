"""The route runner: below the gateway, above the seams; grants, the wait line, retries, repairs, audits.

:mod:`noderuntime.runner.runner` runs one request on routes the trackers grant;
:mod:`~noderuntime.runner.line` is the line of requests waiting for a slot;
:mod:`~noderuntime.runner.policy` what a failure means and whom the next attempt avoids;
:mod:`~noderuntime.runner.affinity` which route holds a prompt's prefix;
:mod:`~noderuntime.runner.audits` checks what a route computed.
"""
