-- No re-send guard (standalone and Sentinel do not re-send a call): see write_guard.lua.
local RG = false
