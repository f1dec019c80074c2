-- SHOW CREATE TABLE of Phorge's daemon log, read off a real Phorge install
-- (Phorge 07c1a51310, MariaDB 10.11, database phabricator_daemon) after `bin/storage upgrade`.
-- Not a worker-queue table: doctor reads it, and each bridge worker and beat lists
-- itself there for Phorge's Daemons console (bridge/runtime/daemon_console.py).

-- daemon_log
CREATE TABLE `daemon_log` (
  `id` int(10) unsigned NOT NULL AUTO_INCREMENT,
  `daemon` varchar(255) NOT NULL,
  `host` varchar(255) NOT NULL,
  `pid` int(10) unsigned NOT NULL,
  `argv` longtext NOT NULL,
  `explicitArgv` longtext NOT NULL,
  `dateCreated` int(10) unsigned NOT NULL,
  `dateModified` int(10) unsigned NOT NULL,
  `status` varchar(8) NOT NULL,
  `runningAsUser` varchar(255) DEFAULT NULL,
  `daemonID` varchar(64) NOT NULL,
  PRIMARY KEY (`id`),
  UNIQUE KEY `key_daemonID` (`daemonID`),
  KEY `status` (`status`),
  KEY `key_modified` (`dateModified`)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin
;
