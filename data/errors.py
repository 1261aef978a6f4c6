"""The one error type for problems a user can fix (a bad config, mismatched inputs, a missing file or tensor).

Entry scripts print a UserError as one line and exit 2; any other exception is a bug and keeps its traceback.
It subclasses ValueError so that callers catching ValueError keep working.
"""


class UserError(ValueError):
    """A problem the user can fix; the message names the file/field at fault and the fix."""
