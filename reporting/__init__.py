"""`distrain report`: reads finished run directories (`report`), draws their plots (`plots`) and sets the
planner's predictions against the measured step (`prediction`). Above the orchestrator and the planning
package, which it only reads; nothing below imports it."""
