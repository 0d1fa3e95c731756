"""Token-budget batching, shared by the teacher (forward batches) and the trainer (micro-batches)."""


def budget_groups(items, length, *, max_tokens=0, max_items=0):
    """Group `items` in order so that each group's padded size, longest x count, stays within max_tokens
    (0: no budget) and its count within max_items (0: no cap). An item longer than the budget alone
    forms a group of its own. length(item) -> tokens."""
    group, longest = [], 0
    for item in items:
        n = length(item)
        if group and ((max_items and len(group) == max_items) or
                      (max_tokens and max(longest, n) * (len(group) + 1) > max_tokens)):
            yield group
            group, longest = [], 0
        group.append(item)
        longest = max(longest, n)
    if group:
        yield group
