"""Where each unit input should live and when it must be read back: the lifetime recorder
(lifetimes) and the TERAIO-style planner (plan). Pure: arithmetic over a timeline of
compute events and tensor lifetimes; no store, and torch only for a GPU's clock."""
